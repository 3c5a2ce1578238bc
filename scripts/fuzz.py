#!/usr/bin/env python
"""Long seeded HTTP fuzz of the gateway and the engine: the cases of tests/fuzz/cases.py, sent by
tests/fuzz/runner.py and judged by tests/fuzz/verdicts.py (its docstring says what counts as a
finding), JSON out.

Starts its own servers on 127.0.0.1 free ports and stops them (only those) at the end:
- gateway: ``modelyard serve`` as a process, API keys on, model m1 on a mock upstream
  (tests/gateway/mock_upstream.py, answering 2 tokens whatever is asked), model ``down`` on a
  port nothing listens on;
- engine: ``python -m engine`` on a tiny random Llama built into a temp dir, or --engine-model.

Exits 1 on any finding (5xx, non-JSON error body, hang, close without answer, RSS over the cap)
or RSS growth over --max-rss-growth-mib, else 0.

    python scripts/fuzz.py --cases 10000 --target both --out fuzz-results.json
    python scripts/fuzz.py --target engine --seed 7 \
        --engine-model models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.net import free_port  # noqa: E402
from tests.fuzz.profile import engine_profile, gateway_profile  # noqa: E402
from tests.fuzz.report import Report  # noqa: E402
from tests.fuzz.runner import Runner, Settings  # noqa: E402
from tests.fuzz.servers import (  # noqa: E402
    GATEWAY_ADMIN_ENV,
    GATEWAY_KEY_ENV,
    GATEWAY_KEYS,
    MIB,
    ProcessServer,
    engine_command,
    gateway_document,
)
from tests.gateway.conftest import MockUpstream  # noqa: E402
from tests.tiny_models import build_tiny_llama  # noqa: E402

ENGINE_NAME = "tiny"
ENGINE_FLAGS = (
    "--kv-cache-memory", "32MiB", "--max-num-seqs", "16", "--max-model-len", "256",
    "--num-threads", "1", "--max-queue", "64",
)  # fmt: skip


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


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "servers": {},
    }
    failed = []
    with tempfile.TemporaryDirectory(prefix="modelyard-fuzz-") as tmp:
        targets = ["gateway", "engine"] if args.target == "both" else [args.target]
        for target in targets:
            fuzz = fuzz_gateway if target == "gateway" else fuzz_engine
            report = await fuzz(args, Path(tmp))
            print(report.summary(examples=30), file=sys.stderr)
            out["servers"][target] = report.figures()
            if report.findings or report.rss_growth > args.max_rss_growth_mib * MIB:
                failed.append(target)
            if report.stopped_early:
                failed.append(f"{target} (stopped early)")
    out["failed"] = failed
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cases", type=int, default=10_000, help="per server")
    parser.add_argument(
        "--index",
        type=int,
        action="append",
        help="run only this case of --seed (repeatable): reproduces a finding",
    )
    parser.add_argument("--target", choices=("gateway", "engine", "both"), default="both")
    parser.add_argument("--engine-model", help="model for the engine (default: a tiny one)")
    parser.add_argument(
        "--engine-arg", action="append", default=[], help="extra `python -m engine` flag"
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="per case, seconds")
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
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
