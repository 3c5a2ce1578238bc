#!/usr/bin/env python
"""Long seeded HTTP fuzz of the gateway and the engine: the cases of scripts/fuzzer/cases.py, sent
by scripts/fuzzer/runner.py and judged by scripts/fuzzer/verdicts.py (its docstring says what
counts as a finding), JSON out.

Starts its own servers on 127.0.0.1 free ports and stops them (only those) at the end:
- gateway: ``modelyard serve`` as a process, API keys on, model m1 on a mock upstream
  (scripts/mock_upstream.py, answering 2 tokens whatever is asked), model ``down`` on a
  port nothing listens on;
- engine: ``python -m engine`` on a tiny random Llama built into a temp dir, or --engine-model.

Exits 1 on any finding (5xx, non-JSON error body, hang, close without answer, RSS over the cap)
or RSS growth over --max-rss-growth-mib, else 0.

``--structured``: constraints instead (scripts/fuzzer/structured_cases.py: JSON schemas, regexes,
Lark/GBNF grammars, choices, tools under tool_choice required; sane, deep, wide, pathological and
garbage), to ``python -m engine`` on the SmolLM2 GGUF (--engine-model) and/or through
``modelyard serve`` (scripts/attacks/fleet.py), from the checkout --repo, while a victim sends
plain requests beside them (scripts/fuzzer/structured_runner.py). Exits 1 unless 0 crashes (the
engine's PID alive throughout), 0 5xx and other findings (a 200 breaking its constraint
included) and the victim's p99 under --victim-p99-ms.

    python scripts/fuzz.py --cases 10000 --target both --out fuzz-results.json
    python scripts/fuzz.py --target engine --seed 7 \
        --engine-model models/SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/fuzz.py --structured --cases 2000 --target engine \
        --out bench-results/fuzz-structured.json
    python scripts/fuzz.py --structured --repo /tmp/modelyard-baseline --target both --cases 300
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.net import free_port  # noqa: E402
from common.processes import alive  # noqa: E402
from scripts.attacks.fleet import MODEL as FLEET_MODEL  # noqa: E402
from scripts.attacks.fleet import Fleet  # noqa: E402
from scripts.fuzzer.logs import LogFile  # noqa: E402
from scripts.fuzzer.profile import engine_profile, gateway_profile  # noqa: E402
from scripts.fuzzer.report import Report  # noqa: E402
from scripts.fuzzer.runner import Runner, Settings  # noqa: E402
from scripts.fuzzer.servers import (  # noqa: E402
    GATEWAY_ADMIN_ENV,
    GATEWAY_KEY_ENV,
    GATEWAY_KEYS,
    MIB,
    ProcessServer,
    engine_command,
    gateway_document,
)
from scripts.fuzzer.structured_report import StructuredReport  # noqa: E402
from scripts.fuzzer.structured_runner import StructuredRunner, StructuredSettings  # noqa: E402
from scripts.measure import write_report  # noqa: E402
from scripts.mock_upstream import MockUpstream  # noqa: E402
from scripts.tiny_models import build_tiny_llama  # noqa: E402

ENGINE_NAME = "tiny"
ENGINE_FLAGS = (
    "--kv-cache-memory", "32MiB", "--max-num-seqs", "16", "--max-model-len", "256",
    "--num-threads", "1", "--max-queue", "64",
)  # fmt: skip
SMOLLM2 = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
STRUCTURED_ENGINE_FLAGS = ("--kv-cache-memory", "256MiB", "--max-num-seqs", "8")  # as the fleet's
RECOVER_S = 180.0
# Per mode: (HTTP, --structured)
DEFAULT_CASES = (10_000, 2000)
DEFAULT_TIMEOUT_S = (10.0, 20.0)
DEFAULT_TARGET = ("both", "engine")


def settings(args: argparse.Namespace) -> Settings:
    return Settings(
        timeout_s=args.timeout,
        incomplete_wait_s=args.incomplete_wait,
        max_wall_s=args.max_seconds,
        rss_headroom=args.rss_cap_mib * MIB,
    )


async def fuzz_gateway(args: argparse.Namespace, tmp: Path) -> Report:
    mock = MockUpstream("fuzz-mock").start()
    try:
        mock.control(tokens=2)  # whatever max_tokens a fuzzed body asks for
        config = tmp / "models.yaml"
        dead = f"http://127.0.0.1:{free_port()}"
        config.write_text(yaml.safe_dump(gateway_document(mock.url, dead)))

        def command(port: int) -> list[str]:
            return [
                sys.executable, "-m", "gateway.cli", "serve", "-c", str(config),
                "--port", str(port), "--log-level", "warning",
            ]  # fmt: skip

        server = ProcessServer("gateway", command, tmp, env=GATEWAY_KEYS, start_timeout_s=30)
        server.start()
        try:
            profile = gateway_profile(
                GATEWAY_KEYS[GATEWAY_KEY_ENV], GATEWAY_KEYS[GATEWAY_ADMIN_ENV]
            )
            return await Runner(server, profile, settings(args)).run(
                args.seed, args.cases, args.index
            )
        finally:
            server.stop()
    finally:
        mock.stop()


async def fuzz_engine(args: argparse.Namespace, tmp: Path) -> Report:
    model = args.engine_model or build_tiny_llama(tmp / "tiny-llama")
    flags = ENGINE_FLAGS + tuple(args.engine_arg)
    server = ProcessServer("engine", engine_command(model, ENGINE_NAME, flags), tmp)
    server.start()
    try:
        runner = Runner(server, engine_profile(ENGINE_NAME), settings(args))
        return await runner.run(args.seed, args.cases, args.index)
    finally:
        server.stop()


class FleetServer:
    """``modelyard serve`` (scripts/attacks/fleet.py) as a structured fuzz target: cases go to
    the gateway, the PID that must survive is its engine's. A restart is the gateway's own after
    a crash (an operator's load when it gave up), or an unload and load of a wedged engine."""

    name = "gateway"
    host = "127.0.0.1"

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.port = urlsplit(fleet.url).port or 0
        self._log = LogFile(fleet.log)

    @property
    def pid(self) -> int:
        return self.fleet.engine_pid or 0

    def alive(self) -> bool:
        return alive(self.pid)

    def new_errors(self) -> list[str]:
        return self._log.new_errors()

    async def restart(self) -> bool:
        action = self.fleet.reset if self.alive() else self.fleet.recover
        return "not ready" not in await asyncio.to_thread(action, RECOVER_S)


def structured_settings(args: argparse.Namespace) -> StructuredSettings:
    return StructuredSettings(
        timeout_s=args.timeout,
        max_wall_s=args.max_seconds,
        max_rung=args.max_rung,
        max_restarts=args.max_restarts,
        victim_p99_ms=args.victim_p99_ms,
        progress_every=100,
    )


async def fuzz_structured(args: argparse.Namespace, tmp: Path, target: str) -> StructuredReport:
    model = Path(args.engine_model or SMOLLM2).resolve()
    if target == "engine":
        flags = STRUCTURED_ENGINE_FLAGS + tuple(args.engine_arg)
        command = engine_command(model, FLEET_MODEL, flags)
        env = {"PYTHONPATH": str(args.repo)}
        server = ProcessServer("engine", command, tmp, env=env, cwd=args.repo).start()
        try:
            runner = StructuredRunner(server, FLEET_MODEL, structured_settings(args))
            return await runner.run(args.seed, args.cases, args.index)
        finally:
            server.stop()
    fleet = Fleet(args.repo, tmp, model)
    try:
        fleet.start(RECOVER_S)
        runner = StructuredRunner(FleetServer(fleet), FLEET_MODEL, structured_settings(args))
        return await runner.run(args.seed, args.cases, args.index)
    finally:
        fleet.stop()


async def run_target(args: argparse.Namespace, tmp: Path, target: str) -> tuple[dict, list[str]]:
    """One server's figures and why it failed (nothing when it passed)."""
    if args.structured:
        structured = await fuzz_structured(args, tmp, target)
        print(structured.summary(examples=30), file=sys.stderr)
        return structured.figures(), structured.problems()
    fuzz = fuzz_gateway if target == "gateway" else fuzz_engine
    report = await fuzz(args, tmp)
    print(report.summary(examples=30), file=sys.stderr)
    failed = []
    if report.findings or report.rss_growth > args.max_rss_growth_mib * MIB:
        failed.append("findings or RSS growth")
    if report.stopped_early:
        failed.append("stopped early")
    return report.figures(), failed


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()},
        "servers": {},
    }
    failed = []
    with tempfile.TemporaryDirectory(prefix="modelyard-fuzz-") as tmp:
        targets = ["gateway", "engine"] if args.target == "both" else [args.target]
        for target in targets:
            out["servers"][target], problems = await run_target(args, Path(tmp), target)
            failed += [f"{target}: {p}" for p in problems]
    out["machine"]["load_average_at_end"] = os.getloadavg()
    out["failed"] = failed
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--structured", action="store_true", help="fuzz constraints (see the docstring)"
    )
    parser.add_argument("--cases", type=int, help="per server (default 10,000; structured 2,000)")
    parser.add_argument(
        "--index",
        type=int,
        action="append",
        help="run only this case of --seed (repeatable): reproduces a finding",
    )
    parser.add_argument(
        "--target", choices=("gateway", "engine", "both"), help="default both; structured: engine"
    )
    parser.add_argument(
        "--engine-model", help="model for the engine (default: a tiny one; structured: SmolLM2)"
    )
    parser.add_argument(
        "--repo", type=Path, default=REPO, help="structured: checkout whose servers to run"
    )
    parser.add_argument(
        "--engine-arg", action="append", default=[], help="extra `python -m engine` flag"
    )
    parser.add_argument(
        "--timeout", type=float, help="per case, seconds (default 10; structured 20)"
    )
    parser.add_argument(
        "--incomplete-wait",
        type=float,
        default=2.0,
        help="how long unfinished requests are left waiting for an answer, seconds",
    )
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="per server")
    parser.add_argument(
        "--rss-cap-mib",
        type=int,
        default=1024,
        help="a server process this far over its warm-up RSS is killed and restarted",
    )
    parser.add_argument(
        "--max-rss-growth-mib", type=float, default=128.0, help="RSS growth that fails the run"
    )
    parser.add_argument(
        "--max-rung", type=int, default=4, help="structured: largest size rung (0-4)"
    )
    parser.add_argument("--max-restarts", type=int, default=20, help="structured: then it stops")
    parser.add_argument(
        "--victim-p99-ms", type=float, default=1000.0, help="structured: the victim's p99 bound"
    )
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    mode = int(args.structured)
    args.cases = args.cases if args.cases is not None else DEFAULT_CASES[mode]
    args.timeout = args.timeout if args.timeout is not None else DEFAULT_TIMEOUT_S[mode]
    args.target = args.target or DEFAULT_TARGET[mode]
    args.repo = args.repo.resolve()
    result = asyncio.run(main_async(args))
    write_report(result, Path(args.out) if args.out else None)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
