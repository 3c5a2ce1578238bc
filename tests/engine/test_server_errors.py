"""HTTP behaviour of the engine server against a fake core: OpenAI error shapes and statuses,
load shedding, readiness while loading and after the loop dies."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest
from aiohttp import web

from engine.serving.app import SETTINGS_KEY, ServerSettings
from engine.serving.server import EngineRunner
from tests.fake_core import FakeCore
from tests.raw_http import assert_openai_error, raw_exchange
from tests.server_utils import InProcessServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def server(tokenizer):
    srv = await InProcessServer(
        lambda: FakeCore(tokenizer, max_model_len=64), ["tiny", "alias"], max_body_bytes=4096
    ).start()
    yield srv
    await srv.stop()


async def _post(url: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        data = raw if raw is not None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        async with session.post(url, data=data, headers=headers) as reply:
            return reply.status, await reply.json(content_type=None)


def _assert_error(payload: dict, param: str | None = None, code: str | None = None) -> dict:
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "Hello"}]


async def test_ok_then_error_shapes(server):
    status, body = await _post(
        server.url + COMPLETIONS, {"model": "alias", "prompt": "Hello", "max_tokens": 3}
    )
    assert status == 200 and body["model"] == "alias" and body["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"model": "tiny", "messages": MSG, "temperature": "hot"}, "temperature"),
        (CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 2.5}, "max_tokens"),
        (CHAT, {"model": "tiny", "messages": MSG, "stream": "yes"}, "stream"),
        (CHAT, {"model": "tiny", "messages": MSG, "n": True}, "n"),
        (CHAT, {"model": "tiny", "messages": MSG, "stop": [1, 2]}, "stop"),
        (CHAT, {"model": "tiny", "messages": MSG, "top_p": 0}, "top_p"),
        (CHAT, {"model": "tiny", "messages": MSG, "temperature": 5}, "temperature"),
        (CHAT, {"model": "tiny", "messages": "hi"}, "messages"),
        (
            CHAT,
            {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
        ),
        (
            CHAT,
            {
                "model": "tiny",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                    }
                ],
            },
            "messages[0].content",
        ),
        (
            CHAT,
            {"model": "tiny", "messages": MSG, "stream_options": {"include_usage": 1}},
            "include_usage",
        ),
        (COMPLETIONS, {"model": "tiny"}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": {"a": 1}}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": ""}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": "hi", "logprobs": True}, "logprobs"),
        (COMPLETIONS, {"model": "tiny", "prompt": "hi", "echo": True}, "echo"),
    ],
)
async def test_bad_parameters_are_400_naming_the_param(server, path, body, param):
    status, payload = await _post(server.url + path, body)
    assert status == 400, payload
    error = _assert_error(payload, param=param)
    assert error["type"] == "invalid_request_error"


async def test_unknown_fields_are_ignored(server):
    body = {"model": "tiny", "messages": MSG, "max_tokens": 2, "frobnicate": {"x": 1}, "user": "u"}
    status, payload = await _post(server.url + CHAT, body)
    assert status == 200, payload


async def test_context_length_error_states_the_numbers(server):
    status, payload = await _post(
        server.url + COMPLETIONS, {"model": "tiny", "prompt": [5] * 40, "max_tokens": 30}
    )
    assert status == 400
    message = _assert_error(payload, code="context_length_exceeded")["message"]
    assert "64" in message and "70" in message and "40" in message and "30" in message


async def test_core_admission_error_reaches_the_caller(server, tokenizer):
    status, payload = await _post(
        server.url + COMPLETIONS, {"model": "tiny", "prompt": [len(tokenizer) + 5], "max_tokens": 2}
    )
    assert status == 400
    assert "vocabulary" in _assert_error(payload)["message"]


async def test_malformed_json_is_400(server):
    status, payload = await _post(server.url + CHAT, None, raw=b'{"model": "tiny", "messages": [')
    assert status == 400
    assert "JSON" in _assert_error(payload)["message"]
    status, payload = await _post(server.url + CHAT, None, raw=b"[1, 2]")
    assert status == 400


async def test_unknown_model_is_404(server):
    status, payload = await _post(server.url + CHAT, {"model": "gpt-4", "messages": MSG})
    assert status == 404
    _assert_error(payload, param="model", code="model_not_found")


async def test_unknown_route_and_method_use_openai_shape(server):
    async with aiohttp.ClientSession() as session:
        async with session.get(server.url + "/v1/nothing") as reply:
            assert reply.status == 404
            _assert_error(await reply.json())
        async with session.get(server.url + CHAT) as reply:
            assert reply.status == 405
            _assert_error(await reply.json())


async def test_oversized_head_is_json_431(server):
    # aiohttp's parser refuses these before any middleware: the runner answers, not the app.
    big_header = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"
    long_line = b"GET /" + b"p" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(200))  # aiohttp's cap is 128 lines
    too_many = b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"
    for request in (big_header, long_line, too_many):
        status, headers, body = await raw_exchange(server.url, request)
        assert status == 431
        assert_openai_error(headers, body, "request_header_fields_too_large")
        message = json.loads(body)["error"]["message"]
        assert "engine's limit of 8190 bytes" in message and b"aaaa" not in body

    # Just under the limit goes the normal way.
    async with (
        aiohttp.ClientSession() as session,
        session.get(server.url + "/health", headers={"X-Big": "a" * 8000}) as reply,
    ):
        assert reply.status == 200


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /health HTTP/1.1 extra\r\nHost: x\r\n\r\n",  # malformed request line
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Name: v\r\n\r\n",
    ],
)
async def test_malformed_http_is_json_400(server, request_bytes):
    status, headers, body = await raw_exchange(server.url, request_bytes)
    assert status == 400
    assert_openai_error(headers, body, "invalid_http_request")


async def test_error_escaping_the_app_is_json_500():
    async def broken(request: web.Request) -> web.Response:
        raise RuntimeError("bug")

    app = web.Application()  # no openai_errors middleware: the error reaches the runner
    app[SETTINGS_KEY] = ServerSettings(["tiny"])
    app.router.add_get("/broken", broken)
    runner = EngineRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        status, headers, body = await raw_exchange(
            f"http://{host}:{port}", b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\n"
        )
    finally:
        await runner.cleanup()
    assert status == 500 and headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error == {
        "message": "Internal engine error.",
        "type": "internal_error",
        "param": None,
        "code": "internal_error",
    }


async def test_body_over_limit_is_413(server):
    body = {"model": "tiny", "prompt": "x" * 5000}
    status, payload = await _post(server.url + COMPLETIONS, body)
    assert status == 413
    _assert_error(payload, code="body_too_large")


async def test_body_over_limit_without_content_length_is_413(server):
    async def chunks():
        for _ in range(10):
            yield b"x" * 1000

    async with (
        aiohttp.ClientSession() as session,
        session.post(server.url + COMPLETIONS, data=chunks()) as reply,
    ):
        assert reply.status == 413
        _assert_error(await reply.json(content_type=None), code="body_too_large")


async def test_load_shedding_is_503(tokenizer):
    srv = await InProcessServer(
        lambda: FakeCore(tokenizer, max_num_seqs=1, step_delay=0.05), ["tiny"], max_queue=2
    ).start()
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 20}
        results = await asyncio.gather(*[_post(srv.url + COMPLETIONS, body) for _ in range(8)])
        statuses = sorted(status for status, _ in results)
        assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
        for status, payload in results:
            if status == 503:
                _assert_error(payload, code="overloaded")
        # once the queue drained, requests are admitted again
        status, _ = await _post(srv.url + COMPLETIONS, body)
        assert status == 200
    finally:
        await srv.stop()


async def test_ready_is_503_while_loading_and_health_is_200(tokenizer):
    gate = threading.Event()
    srv = await InProcessServer(lambda: FakeCore(tokenizer, load_gate=gate), ["tiny"]).start(
        wait_loaded=False
    )
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(srv.url + "/ready") as reply:
                assert reply.status == 503
                _assert_error(await reply.json(), code="not_ready")
            async with session.get(srv.url + "/health") as reply:
                assert reply.status == 200
            status, payload = await _post(srv.url + COMPLETIONS, {"prompt": "hi"})
            assert status == 503
            _assert_error(payload, code="not_ready")
            gate.set()
            await srv.engine.wait_loaded()
            async with session.get(srv.url + "/ready") as reply:
                assert reply.status == 200
    finally:
        gate.set()
        await srv.stop()


async def test_dead_loop_fails_in_flight_and_ready_turns_503(tokenizer):
    srv = await InProcessServer(
        lambda: FakeCore(tokenizer, fail_on_step=3, step_delay=0.01), ["tiny"]
    ).start()
    try:
        status, payload = await _post(srv.url + COMPLETIONS, {"prompt": "hi", "max_tokens": 10})
        assert status == 500
        assert _assert_error(payload)["type"] == "internal_error"
        async with aiohttp.ClientSession() as session:
            async with session.get(srv.url + "/ready") as reply:
                assert reply.status == 503
            async with session.get(srv.url + "/health") as reply:
                assert reply.status == 503
        status, payload = await _post(srv.url + COMPLETIONS, {"prompt": "hi"})
        assert status == 503
        _assert_error(payload, code="engine_dead")
    finally:
        await srv.stop()


async def test_tokenize_detokenize_roundtrip(server, tokenizer):
    status, payload = await _post(server.url + "/tokenize", {"model": "tiny", "prompt": "Hello"})
    assert status == 200
    assert payload["tokens"] == tokenizer("Hello")["input_ids"]
    assert payload["count"] == len(payload["tokens"]) and payload["max_model_len"] == 64
    status, payload2 = await _post(server.url + "/detokenize", {"tokens": payload["tokens"]})
    assert status == 200 and payload2["prompt"] == "Hello"
    status, payload3 = await _post(server.url + "/tokenize", {"messages": MSG})
    assert status == 200 and payload3["count"] > payload["count"]
    status, payload4 = await _post(server.url + "/detokenize", {"tokens": [10**6]})
    assert status == 400
    _assert_error(payload4, param="tokens")


async def test_models_list(server):
    async with aiohttp.ClientSession() as session, session.get(server.url + "/v1/models") as reply:
        payload = await reply.json()
    assert [m["id"] for m in payload["data"]] == ["tiny", "alias"]
    assert all(m["object"] == "model" for m in payload["data"])
