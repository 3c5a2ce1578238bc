"""Stands in for ``python -m engine`` in pool tests: takes the engine's flags, serves the mock
upstream's API under ``--served-model-name``, and answers /ready only after ``--ready-delay-s``.

Test-only flags (passed through ``engine_args`` in models.yaml): ``--ready-delay-s S``,
``--fail-start`` (exit 3 at once, as an engine with a bad model would).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from aiohttp import web
from mock_upstream import MockUpstream, serve  # the script's folder is on sys.path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-delay-s", type=float, default=0.0)
    parser.add_argument("--fail-start", action="store_true")
    args, _engine_flags = parser.parse_known_args()
    if args.fail_start or not Path(args.model).exists():
        sys.exit(3)
    mock = MockUpstream(args.served_model_name)
    ready_at = time.monotonic() + args.ready_delay_s
    base_ready = mock.ready

    async def ready(request: web.Request) -> web.Response:
        if time.monotonic() < ready_at:
            return web.json_response({"status": "loading"}, status=503)
        return await base_ready(request)

    mock.ready = ready  # type: ignore[method-assign]
    serve(mock, args.host, args.port)


if __name__ == "__main__":
    main()
