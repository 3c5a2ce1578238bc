"""A small OpenAI-compatible upstream for gateway tests, benchmarks and the fuzzer: the server
(``MockServer``), run as its own process so that a test can SIGKILL it, and ``MockUpstream``, the
handle that starts one on a free port and drives it:

    python -m scripts.mock_upstream --port 9001 --name up-a

Behaviour is chosen per request by a ``mock`` object in the request body, or for every request by
``POST /control`` with the same object (``{}`` resets). Keys:

- ``fail``: ``429`` / ``500`` / ``503`` (answer that status with an OpenAI error and the headers
  in ``fail_headers``), ``"hang"`` (never answer),
  ``"die"`` (close the connection without answering), ``"die_mid_stream"`` (send two chunks, then
  close the connection), ``"no_done"`` (end the stream cleanly without ``data: [DONE]``),
  ``"crash"`` / ``"crash_mid_stream"`` (the same, but the whole process exits at once: an engine
  that a request kills).
- ``delay_ms``: wait before the response headers; ``chunk_delay_ms``: wait between stream chunks.
- ``tokens``: completion tokens to produce (default 5).
- ``ready``: ``false`` makes /ready and /health answer 503.

``GET /stats`` reports counters and the last request's headers and body, so tests can check what the
gateway forwarded and whether a client disconnect reached the upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from aiohttp import web

from common.net import free_port
from scripts.child_server import ChildServer

DEFAULT_TOKENS = 5
REPO = Path(__file__).resolve().parents[1]


class MockUpstream(ChildServer):
    """A mock upstream in its own process, so a test can SIGKILL it and start it again."""

    what = "mock upstream"

    def __init__(self, name: str = "mock-model", port: int | None = None) -> None:
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 15.0) -> MockUpstream:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scripts.mock_upstream", "--port", str(self.port),
             "--name", self.name],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.wait_answering(self._ready, timeout, 0.05)
        return self

    def _ready(self) -> bool:
        _http_json("GET", self.url + "/ready", timeout=0.5)  # raises until it answers 200
        return True

    def control(self, **settings: Any) -> None:
        _http_json("POST", self.url + "/control", settings)

    def stats(self) -> dict[str, Any]:
        return _http_json("GET", self.url + "/stats")


def _http_json(method: str, url: str, body: Any = None, timeout: float = 5.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class MockServer:
    """The server: its routes, the behaviour ``mock`` asks for, its counters."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.control: dict = {}
        self.stats = {
            "requests": 0,
            "streams_started": 0,
            "streams_completed": 0,
            "streams_aborted": 0,
            "health_checks": 0,
            "requests_cancelled": 0,
        }
        self.last_headers: dict[str, str] = {}
        self.last_body: dict = {}
        # The fast path's answer is the same bytes every time (benchmarks measure the gateway).
        self._fast_cache: dict[tuple[str, str, int], bytes] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/health", self.ready)
        app.router.add_get("/stats", self.get_stats)
        app.router.add_post("/control", self.set_control)
        return app

    async def ready(self, request: web.Request) -> web.Response:
        self.stats["health_checks"] += 1
        if self.control.get("ready", True) is False:
            return web.json_response({"status": "not ready"}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "mock"}]}
        )

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {**self.stats, "last_headers": self.last_headers, "last_body": self.last_body}
        )

    async def set_control(self, request: web.Request) -> web.Response:
        self.control = await request.json()
        return web.json_response({"control": self.control})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._completions(request)
        except asyncio.CancelledError:
            self.stats["requests_cancelled"] += 1  # the client (the gateway) went away
            raise

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.stats["requests"] += 1
        body = await request.json()
        self.last_headers = {k.lower(): v for k, v in request.headers.items()}
        self.last_body = body
        mock = {**self.control, **(body.get("mock") or {})}
        chat = request.path.endswith("/chat/completions")
        model = body.get("model", "")
        tokens = int(mock.get("tokens", body.get("max_tokens") or DEFAULT_TOKENS))
        fail = mock.get("fail")
        if mock.get("delay_ms"):
            await asyncio.sleep(mock["delay_ms"] / 1000)
        if fail in (429, 500, 503):
            error = {
                "message": f"mock failure {fail}",
                "type": "server_error",
                "param": None,
                "code": None,
            }
            return web.json_response(
                {"error": error}, status=fail, headers=mock.get("fail_headers")
            )
        if fail == "hang":
            await asyncio.sleep(3600)
        if fail == "die":
            request.transport.abort()
            await asyncio.sleep(3600)
        if fail == "crash":
            os._exit(1)
        prompt_tokens = _count_prompt_words(body)
        if body.get("stream"):
            return await self._stream(request, body, mock, chat, model, tokens, prompt_tokens)
        key = (request.path, model, tokens)
        cached = self._fast_cache.get(key) if prompt_tokens == 1 else None
        if cached is None:
            cached = json.dumps(_full_response(chat, model, tokens, prompt_tokens)).encode()
            if prompt_tokens == 1:
                self._fast_cache[key] = cached
        return web.Response(body=cached, content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        body: dict,
        mock: dict,
        chat: bool,
        model: str,
        tokens: int,
        prompt_tokens: int,
    ) -> web.StreamResponse:
        self.stats["streams_started"] += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        delay = mock.get("chunk_delay_ms", 0) / 1000
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        try:
            for i in range(tokens):
                if mock.get("fail") == "die_mid_stream" and i == 2:
                    request.transport.abort()
                    return response
                if mock.get("fail") == "crash_mid_stream" and i == 2:
                    os._exit(1)
                await response.write(_sse(_chunk(chat, model, "tok ", None, include_usage)))
                if delay:
                    await asyncio.sleep(delay)
            await response.write(_sse(_chunk(chat, model, "", "length", include_usage)))
            if include_usage:
                usage = _usage(prompt_tokens, tokens)
                final = {**_chunk(chat, model, "", None, False), "choices": [], "usage": usage}
                await response.write(_sse(final))
            if mock.get("fail") != "no_done":
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.stats["streams_aborted"] += 1
            raise
        self.stats["streams_completed"] += 1
        return response


def _count_prompt_words(body: dict) -> int:
    if "messages" in body:
        text = " ".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    else:
        prompt = body.get("prompt", "")
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    return max(1, len(text.split()))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _full_response(chat: bool, model: str, tokens: int, prompt_tokens: int) -> dict:
    text = "tok " * tokens
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
            "logprobs": None,
        }
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
    return {
        "id": "cmpl-mock",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(prompt_tokens, tokens),
    }


def _chunk(chat: bool, model: str, text: str, finish: str | None, usage_null: bool) -> dict:
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    chunk = {
        "id": "cmpl-mock",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if usage_null:
        chunk["usage"] = None
    return chunk


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def serve(upstream: MockServer, host: str, port: int) -> None:
    """Serves ``upstream`` in the foreground until the process is stopped; no access log, no
    banner."""
    web.run_app(
        upstream.app(),
        host=host,
        port=port,
        access_log=None,
        print=None,
        handler_cancellation=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="mock-model")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    serve(MockServer(args.name), args.host, args.port)


if __name__ == "__main__":
    main()
