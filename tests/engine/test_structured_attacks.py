"""Issue 29's structured-output attacks against a real ``python -m engine`` process on the tiny
Llama, bodies generated here: one request must not kill the engine (a deep `$ref` chain, chained
Lark rules, a forced tool call with a deep chain), a slow compile ends with a 400 at its time
limit while plain requests are served, a client that leaves cancels its compile, distinct
repetition bombs do not grow the engine, and SIGTERM during a compile leaves no worker behind."""

from __future__ import annotations

import asyncio

import aiohttp
import psutil
import pytest

from tests.engine.pathological import (
    lark_chain,
    nested_branches,
    ref_chain,
    repetition_bomb,
    tool_with,
)
from tests.engine.server_http import CHAT, COMPLETIONS, post, scrape
from tests.server_utils import EngineProcess

pytestmark = pytest.mark.timeout(240)

FLAGS = ("--kv-cache-memory", "16MiB", "--max-model-len", "512", "--num-threads", "1")
PLAIN = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    proc = EngineProcess(tiny_llama_dir, *FLAGS, "--structured-compile-timeout", "1").wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def chat(**fields: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


async def assert_alive(engine: EngineProcess, pid: int) -> None:
    assert engine.proc.poll() is None and engine.proc.pid == pid, engine.log()
    status, payload = await post(engine.url + COMPLETIONS, PLAIN)
    assert status == 200, payload


def workers_of(engine: EngineProcess) -> list[psutil.Process]:
    return [
        child
        for child in psutil.Process(engine.proc.pid).children()
        if "engine.structured.worker" in " ".join(child.cmdline())
    ]


@pytest.mark.parametrize(
    ("path", "body", "refusal"),
    [
        (
            CHAT,
            chat(response_format=response_format(ref_chain(3000))),
            ("grammar_too_complex", "response_format"),
        ),
        (
            COMPLETIONS,
            {**PLAIN, "structured_outputs": {"grammar": lark_chain(3000)}},
            ("grammar_too_complex", "structured_outputs"),
        ),
        (
            # its prompt (the tool rendered) is too long too: refused for that, and the compile
            # it started (at once, beside the prompt's) must not crash the engine either
            CHAT,
            chat(tools=[tool_with(ref_chain(2500))], tool_choice="required"),
            ("context_length_exceeded", "messages"),
        ),
    ],
    ids=["ref-chain-3000", "lark-chain-3000", "tool-ref-chain-2500"],
)
async def test_one_request_cannot_kill_the_engine(engine, path, body, refusal) -> None:
    pid = engine.proc.pid
    for _ in range(3):  # re-sent, as a gateway once re-sent it to the restarted engine
        status, payload = await post(engine.url + path, body)
        assert status == 400, payload
        assert (payload["error"]["code"], payload["error"]["param"]) == refusal
    await assert_alive(engine, pid)


async def test_a_slow_compile_ends_at_its_limit_while_plain_requests_are_served(engine) -> None:
    pid = engine.proc.pid
    slow = chat(response_format=response_format(nested_branches(50)), max_tokens=4)
    compile_task = asyncio.create_task(post(engine.url + CHAT, slow))
    served = 0
    while not compile_task.done() and served < 50:  # bounded: the compile ends within seconds
        status, _ = await post(engine.url + COMPLETIONS, PLAIN)
        served += status == 200
    status, payload = await compile_task
    assert status == 400 and payload["error"]["code"] == "grammar_too_complex", payload
    assert "within 1 s" in payload["error"]["message"]
    assert served >= 1
    tiny = chat(response_format=response_format({"type": "integer"}), max_tokens=4)
    assert (await post(engine.url + CHAT, tiny))[0] == 200  # the worker came back
    await assert_alive(engine, pid)


async def test_distinct_repetition_bombs_do_not_grow_the_engine(engine) -> None:
    """40 regexes of 141 bytes each once took an engine from 1.55 to 8.2 GB."""

    def resident() -> int:
        process = psutil.Process(engine.proc.pid)
        return process.memory_info().rss + sum(w.memory_info().rss for w in workers_of(engine))

    before = resident()
    for tag in range(40):
        body = {**PLAIN, "structured_outputs": {"regex": repetition_bomb(tag)}}
        status, payload = await post(engine.url + COMPLETIONS, body)
        assert status == 400 and payload["error"]["code"] == "grammar_too_complex", payload
    assert resident() - before < 200 * 2**20
    async with aiohttp.ClientSession() as session, session.get(engine.url + "/status") as reply:
        memory = (await reply.json())["memory"]
    assert memory["structured_cache_bytes"] <= memory["structured_cache_budget_bytes"]


async def test_a_client_that_leaves_cancels_its_compile(engine) -> None:
    slow = chat(response_format=response_format(nested_branches(50, tag="left")), max_tokens=4)
    key = 'modelyard_engine_structured_compiles_total{model_name="tiny",outcome="cancelled"}'
    before = (await scrape(engine.url)).get(key, 0)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TimeoutError):
            async with session.post(engine.url + CHAT, json=slow, timeout=0.2):
                pass
    for _ in range(100):  # bounded: the handler's cancellation reaches the worker
        if (await scrape(engine.url)).get(key, 0) == before + 1:
            break
        await asyncio.sleep(0.05)
    assert (await scrape(engine.url)).get(key, 0) == before + 1  # before its 1 s limit


async def test_sigterm_while_compiling_leaves_no_worker_behind(engine) -> None:
    """Last in this module: it stops the engine. A compile once kept a stopped engine alive
    until SIGKILL."""
    slow = chat(response_format=response_format(nested_branches(50, tag="term")), max_tokens=4)
    compiling = asyncio.create_task(post(engine.url + CHAT, slow))
    for _ in range(100):
        if workers_of(engine):
            break
        await asyncio.sleep(0.05)
    workers = workers_of(engine)
    assert workers
    assert await asyncio.to_thread(engine.stop, 30) == 0, engine.log()
    status, payload = await compiling  # answered, not dropped
    assert status in (400, 503), payload
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive
