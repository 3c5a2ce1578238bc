"""``modelyard serve -c models.yaml`` (or models from the command line: gateway/cli_models.py),
``modelyard check models.yaml`` and ``modelyard ps`` (gateway/ps/)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import signal
import sys

from aiohttp import web

from gateway.app import create_app
from gateway.cli_models import add_model_flags, command_line_fleet, config_text
from gateway.config import ConfigError, FleetConfig, load_config, with_listen
from gateway.engines.process import ENGINE_LAUNCHER
from gateway.ps import command as ps_command
from gateway.server import GatewayRunner
from gateway.state import Gateway

log = logging.getLogger("modelyard.gateway")


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").disabled = True


def check(path: str) -> int:
    try:
        config = load_config(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        print(f"{path}: {len(exc.problems)} problem(s)", file=sys.stderr)
        return 1
    gw = config.gateway
    print(
        f"{path}: OK: listen {gw.host}:{gw.port}, {len(config.models)} model(s), "
        f"{len(gw.auth.keys)} API key(s){' (open mode)' if gw.auth.open_mode else ''}"
    )
    for model in config.models:
        where = (
            f"local {model.source} x{model.replicas}, {model.residency}"
            if model.local
            else ", ".join(model.upstreams)
        )
        aliases = f" (aliases: {', '.join(model.aliases)})" if model.aliases else ""
        print(f"  {model.name}{aliases}: {where}")
    return 0


async def _serve(config: FleetConfig, path: str | None, engine_launcher: tuple[str, ...]) -> None:
    """Serves ``config``, read from ``path`` (reloaded from it), or from the command line."""
    gateway = Gateway(config, path, engine_launcher=engine_launcher)
    app = create_app(gateway)
    # handler_cancellation: a client that disconnects cancels its handler, which closes the
    # upstream request at once instead of letting the engine generate for nobody.
    runner = GatewayRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=30)
    await runner.setup()
    site = web.TCPSite(
        runner, config.gateway.host, config.gateway.port, backlog=2048, reuse_address=True
    )
    await site.start()
    log.info(
        "modelyard gateway listening on http://%s:%d with %d model(s)",
        config.gateway.host,
        config.gateway.port,
        len(config.models),
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(
        signal.SIGHUP, lambda: asyncio.ensure_future(gateway.reload_logged("SIGHUP"))
    )
    try:
        await stop.wait()
        log.info("shutting down: finishing in-flight requests (up to 30 s)")
        gateway.draining = True
    finally:
        await runner.cleanup()


def _run(coro) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """``modelyard``'s parser, and its ``serve`` command's."""
    parser = argparse.ArgumentParser(prog="modelyard", description="Modelyard gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("-c", "--config", help="path to models.yaml (default: models.yaml)")
    serve.add_argument(
        "--host", help="listen on this host, over gateway.listen's (default 127.0.0.1; without API "
        "keys only a loopback address)"
    )  # fmt: skip
    serve.add_argument(
        "--port", type=int, help="listen on this port, over gateway.listen's (default 8000)"
    )
    serve.add_argument(
        "--engine-command",
        help="command that starts an engine, before its flags (default: this Python's -m engine), "
        "e.g. 'numactl --cpunodebind=0 python -m engine'",
    )
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_model_flags(serve)
    checker = sub.add_parser("check", help="validate a models.yaml and list every problem")
    checker.add_argument("config", help="path to models.yaml")
    ps_command.add_parser(sub)
    return parser, serve


def main(argv: list[str] | None = None) -> int:
    parser, serve = build_parser()
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(args.config)
    if args.command == "ps":
        return ps_command.run(args)
    try:
        fleet = command_line_fleet(args, serve)
        if fleet is None:
            if args.print_config:
                serve.error("--print-config prints the models.yaml that PATH or --model give")
            path = args.config or "models.yaml"
            config = with_listen(load_config(path), args.host, args.port)
        else:
            (config, document), path = fleet, None
            if args.print_config:
                print(config_text(document), end="")
                return 0
        _setup_logging(args.log_level)
        launcher = (
            tuple(shlex.split(args.engine_command)) if args.engine_command else ENGINE_LAUNCHER
        )
        _run(_serve(config, path, launcher))
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
