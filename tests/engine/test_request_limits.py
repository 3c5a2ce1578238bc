"""The engine's request limits: n bounded, choices counted in the queue bound, a gone
client's choices all aborted, and 503s that say when to come back (or, for a dead loop,
do not)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.engine.json_requests import (
    COMPLETIONS,
    VALID,
    openai_error,
    post,
)
from tests.fake_core import FakeCore
from tests.server_utils import InProcessServer

pytestmark = pytest.mark.timeout(60)


async def test_n_above_the_cap_is_400(tokenizer):
    srv = await InProcessServer(lambda: FakeCore(tokenizer), ["tiny"], max_queue=1024).start()
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "n": 10_000}
        status, payload, _ = await post(srv.url + COMPLETIONS, body)
        assert status == 400
        assert "128" in openai_error(payload, param="n")["message"]
        assert srv.engine.num_waiting == 0  # refused before it took any place
        status, payload, _ = await post(srv.url + COMPLETIONS, {**body, "n": 128})
        assert status == 200 and len(payload["choices"]) == 128
        assert {c["finish_reason"] for c in payload["choices"]} == {"length"}
    finally:
        await srv.stop()


async def test_n_above_what_the_queue_holds_is_400_not_a_wait(tokenizer):
    srv = await InProcessServer(lambda: FakeCore(tokenizer), ["tiny"], max_queue=4).start()
    try:
        status, payload, _ = await post(srv.url + COMPLETIONS, {**VALID, "n": 5})
        assert status == 400
        assert "between 1 and 4" in openai_error(payload, param="n")["message"]
        status, payload, _ = await post(srv.url + COMPLETIONS, {**VALID, "n": 4})
        assert status == 200 and len(payload["choices"]) == 4
    finally:
        await srv.stop()


async def test_the_queue_bound_counts_choices_and_overload_says_retry_after(tokenizer):
    srv = await InProcessServer(
        lambda: FakeCore(tokenizer, max_num_seqs=1, step_delay=0.05), ["tiny"], max_queue=4
    ).start()
    try:
        long = {"model": "tiny", "prompt": "Hello", "max_tokens": 40}
        running = asyncio.create_task(post(srv.url + COMPLETIONS, long))
        await asyncio.sleep(0.2)  # running: the queue is empty again
        waiting = asyncio.create_task(post(srv.url + COMPLETIONS, {**long, "n": 3}))
        await asyncio.sleep(0.2)  # 3 sequences wait in the core
        assert srv.engine.num_waiting == 3
        status, payload, headers = await post(srv.url + COMPLETIONS, {**long, "n": 2})
        assert status == 503 and headers["Retry-After"] == "1"
        assert "3 sequences" in openai_error(payload, code="overloaded")["message"]
        status, _, _ = await post(srv.url + COMPLETIONS, {**long, "max_tokens": 1})  # 3 + 1 fits
        assert status == 200
        assert (await running)[0] == 200 and (await waiting)[0] == 200
    finally:
        await srv.stop()


async def test_choices_on_their_way_to_the_core_count_too(tokenizer):
    srv = await InProcessServer(
        lambda: FakeCore(tokenizer, step_delay=1.0), ["tiny"], max_queue=4
    ).start()
    try:
        first = asyncio.create_task(post(srv.url + COMPLETIONS, {**VALID, "max_tokens": 3}))
        await asyncio.sleep(1.3)  # the core thread is in its second 1 s step: adds wait for it
        pending = asyncio.create_task(post(srv.url + COMPLETIONS, {**VALID, "n": 3}))
        await asyncio.sleep(0.1)
        assert srv.engine.num_waiting == 3
        status, payload, _ = await post(srv.url + COMPLETIONS, {**VALID, "n": 2})
        assert status == 503
        openai_error(payload, code="overloaded")
        assert (await first)[0] == 200 and (await pending)[0] == 200
    finally:
        await srv.stop()


async def test_a_client_gone_aborts_all_its_choices(tokenizer):
    srv = await InProcessServer(
        lambda: FakeCore(tokenizer, max_num_seqs=1, step_delay=0.05), ["tiny"], max_queue=64
    ).start()
    try:
        busy = asyncio.create_task(post(srv.url + COMPLETIONS, {**VALID, "max_tokens": 200}))
        await asyncio.sleep(0.2)
        gone = asyncio.create_task(post(srv.url + COMPLETIONS, {**VALID, "n": 32}))
        await asyncio.sleep(0.3)
        assert srv.engine.num_waiting == 32
        gone.cancel()  # closes the connection: the handler is cancelled and aborts
        deadline = time.monotonic() + 2.0
        while srv.engine.num_waiting and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert srv.engine.num_waiting == 0 and srv.engine.num_in_flight == 1
        busy.cancel()
    finally:
        await srv.stop()


async def test_503_while_loading_says_retry_after(tokenizer):
    gate = threading.Event()
    srv = await InProcessServer(lambda: FakeCore(tokenizer, load_gate=gate), ["tiny"]).start(
        wait_loaded=False
    )
    try:
        status, payload, headers = await post(srv.url + COMPLETIONS, {"prompt": "hi"})
        assert status == 503 and headers["Retry-After"] == "1"
        openai_error(payload, code="not_ready")
    finally:
        gate.set()
        await srv.stop()


async def test_503_while_shutting_down_says_retry_after_and_a_dead_loop_does_not(tokenizer):
    srv = await InProcessServer(lambda: FakeCore(tokenizer, fail_on_step=2), ["tiny"]).start()
    try:
        srv.engine.accepting = False
        status, payload, headers = await post(srv.url + COMPLETIONS, VALID)
        assert status == 503 and headers["Retry-After"] == "1"
        openai_error(payload, code="shutting_down")
        srv.engine.accepting = True
        assert (await post(srv.url + COMPLETIONS, {**VALID, "max_tokens": 5}))[0] == 500
        status, payload, headers = await post(srv.url + COMPLETIONS, VALID)
        assert status == 503 and "Retry-After" not in headers
        openai_error(payload, code="engine_dead")
    finally:
        await srv.stop()


async def test_requests_waiting_for_the_prompt_thread_count_too(tokenizer):
    """A request being templated and tokenised (one at a time, on the prompt thread) holds its
    places in the bound: a flood of long prompts cannot line up there past --max-queue."""
    srv = await InProcessServer(lambda: FakeCore(tokenizer), ["tiny"], max_queue=4).start()
    engine = srv.engine
    release = threading.Event()
    try:
        blocker = asyncio.ensure_future(engine.on_prompt_thread(lambda _: release.wait(10)))
        waiting = asyncio.create_task(post(srv.url + COMPLETIONS, {**VALID, "n": 3}))
        tokenize = asyncio.create_task(
            post(srv.url + "/tokenize", {"model": "tiny", "prompt": "hello"})
        )
        deadline = time.monotonic() + 5
        while engine.num_waiting < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert engine.num_waiting == 4  # 3 choices + 1 tokenize, none in the core yet
        status, payload, _ = await post(srv.url + COMPLETIONS, VALID)
        assert status == 503
        assert "4 sequences" in openai_error(payload, code="overloaded")["message"]
        release.set()
        await blocker
        assert (await waiting)[0] == 200 and (await tokenize)[0] == 200
        assert engine.num_waiting == 0
    finally:
        release.set()
        await srv.stop()
