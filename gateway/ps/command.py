"""``modelyard ps [--url URL] [--json] [--watch [SECONDS]]``: the table (or the rows as JSON) once,
or again every ``SECONDS`` until Ctrl-C. A failure is one line on stderr and exit status 1; under
``--watch`` a gateway that does not answer (restarting, say) is shown as that line and asked
again, while a refused key or an answer that is not the admin API's ends the watch."""

from __future__ import annotations

import argparse
import json
import sys
import time

from gateway.config import ADMIN_KEY_ENV
from gateway.ps.fetch import (
    DEFAULT_URL,
    URL_ENV,
    PsError,
    Unreachable,
    fetch_models,
    gateway_url,
)
from gateway.ps.rows import memory, rows
from gateway.ps.table import render

DEFAULT_WATCH_S = 2.0
CLEAR_SCREEN = "\x1b[H\x1b[2J"


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ps = commands.add_parser(
        "ps", help="the models and replicas of a running gateway: state, memory, load"
    )
    ps.add_argument(
        "--url", help=f"the gateway (default: ${URL_ENV}, else {DEFAULT_URL}); a /v1 suffix is fine"
    )
    ps.add_argument(
        "--admin-key-env",
        default=ADMIN_KEY_ENV,
        metavar="NAME",
        help="the environment variable holding the admin key, as the gateway's "
        f"gateway.auth.admin_key_env names it (default: {ADMIN_KEY_ENV})",
    )
    ps.add_argument("--json", action="store_true", help="the rows as a JSON list of objects")
    ps.add_argument(
        "--watch",
        nargs="?",
        const=DEFAULT_WATCH_S,
        type=_positive,
        metavar="SECONDS",
        help=f"show it again every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C",
    )
    ps.add_argument(
        "--timeout", type=_positive, default=5.0, metavar="SECONDS", help="for each answer"
    )


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    try:
        url = gateway_url(args.url)
        if args.watch is None:
            print(_show(url, args))
            return 0
        _watch(url, args)
    except PsError as failure:
        print(f"modelyard ps: {failure}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def _show(url: str, args: argparse.Namespace) -> str:
    listing = fetch_models(url, args.admin_key_env, args.timeout)
    found = rows(listing)
    if args.json:
        return json.dumps(found, indent=None if args.watch else 2)
    return render(url, memory(listing), found)


def _watch(url: str, args: argparse.Namespace) -> None:
    """Each frame: a cleared screen on a terminal (else a blank line between frames), the time
    and the table; as JSON, one list per line. An unreachable gateway's line goes to stderr."""
    clear = CLEAR_SCREEN if sys.stdout.isatty() and not args.json else ""
    while True:
        print(clear, end="")
        try:
            frame = _show(url, args)
        except Unreachable as failure:
            print(f"modelyard ps: {failure}", file=sys.stderr, flush=True)
        else:
            if not args.json:
                frame = f"{time.strftime('%H:%M:%S')}  every {args.watch:g}s\n{frame}\n"
            print(frame, flush=True)
        time.sleep(args.watch)
