"""The official ``openai`` SDK, unchanged, against a real engine process (sync and async clients,
streaming and not, models.list, errors, and Chinese text streamed without broken characters)."""

from __future__ import annotations

import openai
import pytest

from tests.server_utils import EngineProcess

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    proc = EngineProcess(
        tiny_llama_dir,
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "512",
        "--num-threads",
        "1",
        names=("tiny", "tiny-alias"),
    ).wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def client(engine):
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(engine):
    return openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


def test_models_list(client):
    assert [m.id for m in client.models.list()] == ["tiny", "tiny-alias"]


def test_sync_chat_streaming_equals_non_streaming(client):
    kwargs = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    reply = client.chat.completions.create(**kwargs)
    assert reply.object == "chat.completion" and reply.model == "tiny"
    assert reply.usage.completion_tokens == 10 and reply.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == reply.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_sync_completions(client):
    reply = client.completions.create(
        model="tiny-alias", prompt="The quick brown fox", max_tokens=6, temperature=0, logprobs=2
    )
    assert reply.object == "text_completion" and reply.model == "tiny-alias"
    assert len(reply.choices[0].logprobs.tokens) == reply.usage.completion_tokens
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=6, temperature=0, stream=True
        )
    )
    assert streamed == reply.choices[0].text


def test_sdk_errors(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100000)
    assert "512" in bad.value.message
    with pytest.raises(openai.BadRequestError) as typed:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, extra_body={"top_k": "many"}
        )
    assert typed.value.param == "top_k"


async def test_async_chat_streaming_and_not(aclient):
    kwargs = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_completion_tokens": 8,
        "temperature": 0,
        "seed": 7,
        "user": "someone",
        "extra_body": {"ignore_eos": True},
    }
    reply = await aclient.chat.completions.create(**kwargs)
    assert reply.usage.completion_tokens == 8
    stream = await aclient.chat.completions.create(**kwargs, stream=True)
    text = ""
    async for chunk in stream:
        text += chunk.choices[0].delta.content or ""
    assert text == reply.choices[0].message.content
    models = await aclient.models.list()
    assert [m.id async for m in models] == ["tiny", "tiny-alias"]


async def test_async_completions_stream(aclient):
    stream = await aclient.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].usage.completion_tokens <= 5
    assert all(c.object == "text_completion" for c in chunks)


def test_chinese_prompt_streams_back_intact_on_the_tiny_model(client):
    """A random model emits arbitrary byte tokens (some are invalid UTF-8 and decode to U+FFFD
    in any decoder); what streaming must guarantee is that chunking adds no broken characters:
    the streamed deltas join to exactly the non-streamed text, CJK characters included."""
    kwargs = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "你好，世界。今天天气很好。"}],
        "max_tokens": 48,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    reply = client.chat.completions.create(**kwargs)
    full = reply.choices[0].message.content
    assert any("\u4e00" <= ch <= "\u9fff" for ch in full), "expected CJK in the tiny model's reply"
    deltas = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kwargs, stream=True)
    ]
    assert "".join(deltas) == full
    assert sum(d.count("\ufffd") for d in deltas) == full.count("\ufffd")


@pytest.mark.smollm2
@pytest.mark.slow
def test_chinese_streamed_back_by_smollm2(smollm2_gguf):
    proc = EngineProcess(
        smollm2_gguf, "--kv-cache-memory", "64MiB", "--max-model-len", "512", names=("smollm2",)
    ).wait_ready(timeout=600)
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
        kwargs = {
            "model": "smollm2",
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Say 你好 in Chinese characters."}],
        }
        full = client.chat.completions.create(**kwargs).choices[0].message.content
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**kwargs, stream=True)
        )
        assert streamed == full
        assert "你好" in streamed and "\ufffd" not in streamed
    finally:
        assert proc.stop() == 0
