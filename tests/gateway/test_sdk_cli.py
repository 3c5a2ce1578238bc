"""`modelyard serve` as a real process, used through the official openai SDK; SIGHUP reload;
`modelyard serve PATH` with a tiny model and no models.yaml."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from common.net import free_port
from scripts.mock_upstream import MockUpstream
from tests.gateway.conftest import fleet
from tests.gateway.serve_process import REPO_ROOT, ServeProcess

SECRET = "sk-sdk-test"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[ServeProcess, MockUpstream, Path]]:
    """The gateway (info-level log, access log in the returned file) before a mock upstream."""
    upstream = MockUpstream("m1").start()
    doc = fleet([upstream.url])
    doc["gateway"]["auth"] = {"keys": [{"name": "sdk", "key_env": "SDK_TEST_KEY"}]}
    folder = tmp_path_factory.mktemp("sdk")
    access_log = folder / "access.log"
    gateway = ServeProcess(
        doc,
        folder,
        free_port(),
        env={"SDK_TEST_KEY": SECRET},
        log_level="info",
        access_log=access_log,
    )
    try:
        gateway.wait_serving()
        yield gateway, upstream, access_log
    finally:
        gateway.stop()
        upstream.stop()


def test_sync_sdk(served):
    gateway, _, _ = served
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=SECRET, max_retries=0)
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.choices[0].message.content == "tok tok tok "
    assert chat.model == "m1" and chat.usage.completion_tokens == 3
    text = client.completions.create(model="m1", prompt="a b", max_tokens=2)
    assert text.choices[0].text == "tok tok "
    assert {m.id for m in client.models.list()} == {"m1", "default"}
    stream = client.chat.completions.create(
        model="m1",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok " * 4
    assert chunks[-1].usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


async def test_async_sdk_streaming(served):
    gateway, _, _ = served
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=SECRET, max_retries=0)
    stream = await client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
    )
    pieces = [c.choices[0].delta.content async for c in stream if c.choices]
    assert "".join(p or "" for p in pieces) == "tok " * 5
    chat = await client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert chat.choices[0].finish_reason == "length"
    models = await client.models.list()
    assert "default" in {m.id async for m in models}
    await client.close()


def test_sdk_sees_mid_stream_error(served):
    gateway, upstream, _ = served
    upstream.control(fail="die_mid_stream")
    try:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=SECRET, max_retries=0)
        stream = client.chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
    finally:
        upstream.control()


def test_sighup_reload_and_access_log(served):
    """SIGHUP reloads models.yaml; the access log has one JSON line per request."""
    gateway, upstream, access_log = served
    doc = yaml.safe_load(gateway.config.read_text())
    doc["models"][0]["aliases"] = ["default", "via-sighup"]
    gateway.config.write_text(yaml.safe_dump(doc))
    gateway.proc.send_signal(signal.SIGHUP)
    request = urllib.request.Request(
        gateway.url + "/v1/chat/completions",
        method="POST",
        data=json.dumps(
            {"model": "via-sighup", "messages": [{"role": "user", "content": "x"}]}
        ).encode(),
        headers={
            "Authorization": f"Bearer {SECRET}",
            "Content-Type": "application/json",
            "x-request-id": "trace-me-42",
        },
    )
    deadline = time.monotonic() + 5
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                assert resp.status == 200
                break
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert "config reloaded (SIGHUP)" in gateway.stderr(tail=None)
    deadline = time.monotonic() + 5
    entry = None
    while entry is None and time.monotonic() < deadline:
        entries = [json.loads(x) for x in access_log.read_text().splitlines()]
        # Tries before the reload was applied were logged as 404s under the same id.
        entry = next(
            (e for e in entries if e["request_id"] == "trace-me-42" and e["status"] == 200), None
        )
        time.sleep(0.05)
    assert entry is not None
    assert entry["status"] == 200 and entry["model"] == "m1" and entry["key"] == "sdk"
    assert entry["backend"] == upstream.url.split("://")[1]
    assert entry["prompt_tokens"] == 1 and entry["completion_tokens"] == 5
    assert entry["latency_ms"] > 0
    assert SECRET not in access_log.read_text() + gateway.stderr(tail=None)


def test_serve_refuses_bad_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: []\n")
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "-c", str(bad)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert f"{bad}: models: must be a non-empty list" in result.stderr


def test_serve_path_answers_under_the_models_own_name(tiny_llama_dir: Path, tmp_path: Path):
    """The shortest way to an endpoint: one model, no models.yaml, served under its name (a
    file's stem; here a folder's) and answering the SDK through a real engine."""
    model = tmp_path / "tiny-chat"
    model.symlink_to(tiny_llama_dir, target_is_directory=True)
    engine = ["--device", "cpu", "--max-model-len", "256", "--kv-cache-memory", "64MiB"]
    gateway = ServeProcess(
        None,
        tmp_path,
        free_port(),
        models_args=[str(model), *engine, "--engine-args=--num-threads 1"],
    )
    try:
        gateway.wait_serving(timeout=120)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-chat"]
        reply = client.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": "Hello"}], max_tokens=4
        )
        assert reply.model == "tiny-chat" and reply.usage.completion_tokens >= 1
        assert isinstance(reply.choices[0].message.content, str)
    finally:
        gateway.stop()
