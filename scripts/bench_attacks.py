#!/usr/bin/env python
"""Denial-of-service benchmark: known attacks replayed against a real `modelyard serve` (gateway
plus its engine) while a victim client keeps sending valid requests, JSON out.

Each run starts the gateway from a checkout (``--repo``, default this one) with a temporary
models.yaml (the SmolLM2 GGUF, one replica, 256 MiB KV cache, max_num_seqs 8) on a free
loopback port, finds its engine (``/admin/prometheus/targets``, the gateway's child in /proc)
and replays, one after another (3 first, see ATTACKS): (1) a deflate bomb (1 MiB -> 1 GiB) and
gzip'd 256 MiB of spaces, to the gateway and the engine; (2) ``n=10000`` on /v1/completions,
the client giving up after 10 s; (3) rounds of engine-500 bodies (``"role": ["user"]``) that
may eject the only backend; (4) a 4 MB prompt (chat and completion, gateway and engine);
(5) slow clients (header and body at 1 byte / 2 s, an idle keep-alive connection) and
``--connections`` silent connections; (6) small poison bodies; then issue 29's (ids ``h``,
scripts/attacks/suite.py lists them): constraints that crash the grammar compiler (h1a-c),
compile for minutes (h2 patternProperties, h3 anyOf, with every 200 checked against its
constraint) or fill the compile cache (h4), floods of empty messages (h5), park/load loops and an
unload during a load of an on-demand model beside traffic (h6a-b); all from 127.0.0.3. Meanwhile a
victim (its own thread, from 127.0.0.2, a fresh connection per request) sends small chat
requests and polls both ``/health`` endpoints, and /proc/PID/status VmRSS of both processes is
sampled every 50 ms (the engine's with its descendants). Per attack: the attack's answer, the
victim's requests during and right after it (success, p50, p99, max), the max /health latency
(during and right after), the peak RSS, and whether the engine is alive at the end, the same
process, how often the gateway restarted it and the model's state (/admin/models, with the admin
key the fleet sets). Before each attack the model is made ready again (a load after a crash loop,
an unload and load when a tiny schema no longer compiles).

``--compare BASELINE`` runs BASELINE first, then ``--repo``, and adds ``side_by_side``: each
figure for both, with baseline/current ratios for times and sizes (``_ms``, ``_s``, ``_mb``).
Every loop is bounded in count and time; a failed attack is reported, not fatal.
This file is the command line; the fleet, the victim and the attacks are in scripts/attacks/.

    git worktree add --detach /tmp/modelyard-baseline c1242b8
    .venv/bin/python scripts/bench_attacks.py --compare /tmp/modelyard-baseline \\
        --out bench-results/attacks.json
    .venv/bin/python scripts/bench_attacks.py --only 1a,5a --slow-cap-s 20
    .venv/bin/python scripts/bench_attacks.py --only h --repo /tmp/modelyard-baseline \\
        --out bench-results/attacks-29-baseline.json
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script: make `common` and `scripts` importable

from common.http_server import raise_fd_limit  # noqa: E402
from scripts.attacks.bodies import build_payloads  # noqa: E402
from scripts.attacks.report import print_table, side_by_side  # noqa: E402
from scripts.attacks.suite import run_suite, selected  # noqa: E402
from scripts.measure import write_report  # noqa: E402


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--repo", type=Path, default=REPO, help="checkout whose servers to attack (default: this)")
    add("--compare", type=Path, metavar="BASELINE", help="run this checkout first, side by side")
    add("--model", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    add("--only", default="", help="comma-separated attack ids, e.g. 1a,3,5b (default: all)")
    add("--connections", type=int, default=20300, help="silent connections of attack 5b")
    add("--hold-s", type=float, default=10.0, help="how long 5b holds them")
    add("--slow-cap-s", type=float, default=60.0, help="longest wait on one slow client")
    add("--give-up-s", type=float, default=10.0, help="attack 2's client timeout")
    add("--rounds", type=int, default=3, help="attack 3's rounds")
    add("--bodies-per-round", type=int, default=5)
    add("--crash-sends", type=int, default=3, help="h1: sends of each crashing constraint")
    add("--crash-timeout-s", type=float, default=45.0, help="h1: client timeout of each send")
    add("--compile-give-up-s", type=float, default=5.0, help="h2: client timeout")
    add("--anyof-variants", type=int, default=4, help="h3: distinct 5,000-branch anyOfs")
    add("--flood-s", type=float, default=30.0, help="h5: how long the two senders send")
    add("--residency-s", type=float, default=40.0, help="h6a: how long park/load loops run")
    add("--after-s", type=float, default=3.0, help="victim window right after each attack")
    add("--victim-concurrency", type=int, default=3)
    add("--ready-timeout", type=float, default=300.0, help="gateway + engine start-up bound")
    add("--out", type=Path, help="write the JSON report here too")
    args = p.parse_args(argv)
    args.repo, args.model = args.repo.resolve(), args.model.resolve()
    if args.compare:
        args.compare = args.compare.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_cli(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the servers are stopped
    names = selected(args.only)
    started = time.monotonic()
    report: dict[str, Any] = {
        "benchmark": "denial-of-service attacks against modelyard serve, with a victim client",
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_at_start": os.getloadavg(),
            "nofile_limit": raise_fd_limit(logging.getLogger("bench_attacks")),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    print("building payloads ...", file=sys.stderr, flush=True)
    payloads = build_payloads()
    if args.compare:
        report["baseline"] = run_suite(args.compare, args, payloads, names)
        report["current"] = run_suite(args.repo, args, payloads, names)
        report["side_by_side"] = side_by_side(report["baseline"], report["current"])
    else:
        report["result"] = run_suite(args.repo, args, payloads, names)
    report["machine"]["load_average_at_end"] = os.getloadavg()
    report["seconds"] = round(time.monotonic() - started, 1)
    write_report(report, args.out)
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
