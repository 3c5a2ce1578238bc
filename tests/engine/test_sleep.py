"""Sleep and wake: the core's guards (no work while asleep, no sleep while busy), then a real
``python -m engine`` process (vLLM's /sleep, /wake_up, /is_sleeping) and its /status: greedy
answers identical across a park, weights and KV cache out of the process's memory while asleep
(its own report and /proc/<pid>/status agree), 503s while asleep, 409 while a request runs,
idempotent switches, cycles that do not grow the process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from common.processes import rss_bytes
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.errors import EngineBusyError, EngineSleepingError
from scripts.tiny_models import build_tiny_llama
from tests.engine.server_http import CHAT, COMPLETIONS, chat_body, post, scrape
from tests.server_utils import EngineProcess

pytestmark = pytest.mark.timeout(120)

KV_BYTES = 64 * 2**20
PROMPTS = ["The quick brown fox", "Paged attention stores", "def main():", "你好，世界"]
SLACK = 16 * 2**20  # what a process may grow by across cycles (allocator, request bookkeeping)


def _build_wide_llama(path: Path) -> Path:
    """A Llama wide enough (~35 MB of fp32 weights, ~100 MB with the prepacked copies) that its
    weights show in the process's RSS, not only the KV cache."""
    return build_tiny_llama(
        path, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
        num_kv_heads=4, max_positions=512,
    )  # fmt: skip


def _greedy_tokens(core: EngineCore, request_id: str, prompt: list[int]) -> list[int]:
    core.add_request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0))
    tokens: list[int] = []
    for _ in range(100):
        for out in core.step():
            tokens += out.outputs[0].token_ids
            if out.finished:
                return tokens
    raise AssertionError("request did not finish")


def test_core_takes_no_work_asleep_and_does_not_sleep_busy(tiny_llama_dir):
    config = EngineConfig(
        str(tiny_llama_dir), num_threads=1, max_model_len=64, kv_cache_memory=2**22
    )
    core = EngineCore(config)
    prompt = [40, 41, 42, 43, 44, 45, 46]
    expected = _greedy_tokens(core, "before", prompt)
    awake = core.footprint()
    core.add_request("busy", prompt, SamplingParams(max_tokens=4))
    with pytest.raises(EngineBusyError, match="1 request running"):
        core.sleep()
    core.abort("busy")
    core.sleep()
    asleep = core.footprint()
    assert asleep.sleeping and asleep.weights_bytes == 0 and asleep.kv_cache_bytes == 0
    assert asleep.park.parks == 1 and asleep.park.weight_bytes_parked == awake.weights_bytes
    with pytest.raises(EngineSleepingError):
        core.add_request("asleep", prompt, SamplingParams(max_tokens=4))
    core.wake_up()
    woken = core.footprint()
    assert (woken.weights_bytes, woken.kv_cache_bytes) == (
        awake.weights_bytes,
        awake.kv_cache_bytes,
    )
    assert _greedy_tokens(core, "after", prompt) == expected


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    model = _build_wide_llama(tmp_path_factory.mktemp("wide-llama"))
    flags = ("--kv-cache-memory", "64MiB", "--num-threads", "1", "--max-model-len", "256")
    proc = EngineProcess(model, *flags).wait_ready()
    yield proc
    proc.stop()


async def _call(method: str, url: str, body: dict | None = None) -> tuple[int, dict, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, json=body) as reply,
    ):
        return reply.status, await reply.json(), dict(reply.headers)


async def _answers(url: str) -> list[str]:
    """Greedy completions and chats of every prompt."""
    texts = []
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
        status, reply = await post(url + COMPLETIONS, body)
        assert status == 200, reply
        texts.append(reply["choices"][0]["text"])
        status, reply = await post(url + CHAT, chat_body(prompt, max_tokens=12))
        assert status == 200, reply
        texts.append(reply["choices"][0]["message"]["content"])
    return texts


def _vm_rss(proc: EngineProcess) -> int:
    rss = rss_bytes(proc.proc.pid)
    assert rss is not None, "the engine is gone"
    return rss


async def _status(url: str) -> dict:
    status, body, _ = await _call("GET", url + "/status")
    assert status == 200
    return body


async def test_asleep_releases_memory_refuses_requests_and_wakes_with_the_same_answers(engine):
    url = engine.url
    before = await _answers(url)
    awake = await _status(url)
    memory = awake["memory"]
    assert awake["device"] == "cpu" and not awake["sleeping"]
    assert memory["kv_cache_bytes"] == KV_BYTES and memory["weights_bytes"] > 64 * 2**20
    assert memory["activation_bytes"] > 0 and memory["activation_bytes_source"] == "estimate"
    rss_awake = _vm_rss(engine)

    status, body, _ = await _call("POST", url + "/sleep?level=1")
    assert (status, body) == (200, {"is_sleeping": True})
    asleep = await _status(url)
    assert asleep["sleeping"]
    assert asleep["memory"]["weights_bytes"] == 0 and asleep["memory"]["kv_cache_bytes"] == 0
    assert asleep["park"]["parks"] == awake["park"]["parks"] + 1
    assert asleep["park"]["weight_bytes_parked"] == memory["weights_bytes"]
    released = memory["weights_bytes"] + memory["kv_cache_bytes"]
    assert rss_awake - _vm_rss(engine) >= 0.8 * released
    assert memory["rss_bytes"] - asleep["memory"]["rss_bytes"] >= 0.8 * released

    assert (await _call("GET", url + "/is_sleeping"))[1] == {"is_sleeping": True}
    samples = await scrape(url)
    assert samples['modelyard_engine_sleeping{model_name="tiny"}'] == 1.0
    assert samples['modelyard_engine_weights_bytes{model_name="tiny"}'] == 0.0
    assert samples['modelyard_engine_kv_cache_bytes{model_name="tiny"}'] == 0.0
    status, body, _ = await _call("GET", url + "/ready")
    assert status == 503 and body["error"]["code"] == "engine_sleeping"
    assert (await _call("GET", url + "/health"))[0] == 200
    refused = [
        (COMPLETIONS, {"model": "tiny", "prompt": "Hi", "max_tokens": 2}),
        (CHAT, chat_body("Hi", max_tokens=2)),
        ("/tokenize", {"model": "tiny", "prompt": "Hi"}),
    ]
    for path, request in refused:
        status, body, headers = await _call("POST", url + path, request)
        assert status == 503 and body["error"]["code"] == "engine_sleeping", (path, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert headers["Retry-After"] == "1"

    status, body, _ = await _call("POST", url + "/wake_up")
    assert (status, body) == (200, {"is_sleeping": False})
    woken = await _status(url)
    assert not woken["sleeping"] and woken["park"]["wakes"] == awake["park"]["wakes"] + 1
    assert woken["memory"]["weights_bytes"] == memory["weights_bytes"]
    assert woken["memory"]["kv_cache_bytes"] == KV_BYTES
    assert (await _call("GET", url + "/ready"))[0] == 200
    samples = await scrape(url)
    assert samples['modelyard_engine_sleeping{model_name="tiny"}'] == 0.0
    assert samples['modelyard_engine_kv_cache_bytes{model_name="tiny"}'] == KV_BYTES
    assert samples['modelyard_engine_last_wake_seconds{model_name="tiny"}'] > 0
    assert await _answers(url) == before


async def test_sleep_and_wake_are_idempotent_and_only_level_1_exists(engine):
    url = engine.url
    start = (await _status(url))["park"]
    for level in ("2", "0", "deep"):
        status, body, _ = await _call("POST", url + f"/sleep?level={level}")
        assert status == 400 and body["error"]["param"] == "level", body
        assert body["error"]["type"] == "invalid_request_error"
    assert not (await _status(url))["sleeping"]
    for _ in range(2):
        assert (await _call("POST", url + "/sleep"))[:2] == (200, {"is_sleeping": True})
    assert (await _status(url))["park"]["parks"] == start["parks"] + 1
    for _ in range(2):
        assert (await _call("POST", url + "/wake_up"))[:2] == (200, {"is_sleeping": False})
    assert (await _status(url))["park"]["wakes"] == start["wakes"] + 1


async def test_sleep_is_refused_with_409_while_a_request_runs(engine):
    url = engine.url
    body = chat_body("Hello", max_tokens=200, ignore_eos=True, stream=True)
    async with aiohttp.ClientSession() as session, session.post(url + CHAT, json=body) as reply:
        for _ in range(3):  # role chunk, blank line, first token: it is running now
            await reply.content.readline()
        status, refused, _ = await _call("POST", url + "/sleep")
        assert status == 409 and refused["error"]["code"] == "engine_busy", refused
        assert "1 request in flight" in refused["error"]["message"]
        assert (await _call("GET", url + "/is_sleeping"))[1] == {"is_sleeping": False}
    # the client left: the request is aborted, and the engine may sleep once it is gone
    for _ in range(50):
        status, _, _ = await _call("POST", url + "/sleep")
        if status == 200:
            break
        assert status == 409
        await asyncio.sleep(0.1)
    assert status == 200
    assert (await _call("POST", url + "/wake_up"))[0] == 200


async def test_park_and_wake_cycles_do_not_grow_the_process(engine):
    url = engine.url
    parked, awake = [], []
    for _ in range(3):
        assert (await _call("POST", url + "/sleep"))[0] == 200
        parked.append(_vm_rss(engine))
        assert (await _call("POST", url + "/wake_up"))[0] == 200
        status, _ = await post(url + COMPLETIONS, {"prompt": "Hello", "max_tokens": 4})
        assert status == 200
        awake.append(_vm_rss(engine))
    assert max(parked) <= parked[0] + SLACK, parked
    assert max(awake) <= awake[0] + SLACK, awake
