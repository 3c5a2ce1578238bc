"""common/json_body.py and common/request_body.py's decoder on their own: strict JSON, and
decompression that never inflates past its cap."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest

from common.errors import RequestRefused
from common.json_body import MAX_DEPTH, parse_json
from common.request_body import _Inflater


def _refusal(body: bytes) -> RequestRefused:
    with pytest.raises(RequestRefused) as info:
        parse_json(body)
    assert info.value.status == 400 and info.value.code == "invalid_json"
    return info.value


def test_valid_json_with_surrogate_pairs_and_deep_but_allowed_nesting():
    assert parse_json(b'{"s": "\\ud83d\\ude00 ok"}') == {"s": "\U0001f600 ok"}
    nested = b"[" * (MAX_DEPTH - 1) + b"1" + b"]" * (MAX_DEPTH - 1)
    assert parse_json(nested)
    # Many brackets inside strings trigger the walk, which finds nothing wrong.
    assert parse_json(json.dumps({"p": "[" * 5000}).encode()) == {"p": "[" * 5000}
    assert parse_json(b'{"path": "C:\\\\ud800"}') == {"path": "C:\\ud800"}  # an escaped backslash


@pytest.mark.parametrize(
    "body",
    [
        b'{"content": "\\ud800"}',
        b'{"content": "x\\udfff"}',
        b'{"\\udbff": 1}',  # in a key
        b'{"a": [{"b": ["\\uD800"]}]}',
        b'{"ok": "\\ud83d\\ude00", "bad": "\\ude00\\ud83d"}',  # a pair in the wrong order
    ],
)
def test_lone_surrogate_escapes_are_refused(body):
    assert "surrogate" in _refusal(body).message


@pytest.mark.parametrize(
    "body",
    [
        b'{"content": "\xed\xa0\x80"}',  # a surrogate encoded as UTF-8 (json.loads(bytes) takes it)
        b'{"content": "\xff"}',
        b"\xef\xbb\xbf{}",  # a UTF-8 byte-order mark
        '{"a": 1}'.encode("utf-16"),
    ],
)
def test_bodies_that_are_not_plain_utf8_are_refused(body):
    _refusal(body)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1000, 100_000])
def test_deep_nesting_is_refused(depth):
    for opener, closer in ((b"[", b"]"), (b'{"a":', b"}")):
        body = opener * depth + b"1" + closer * depth
        assert "deeper than" in _refusal(body).message


def test_not_json_is_refused():
    _refusal(b'{"model": "m", "messages": [')
    _refusal(b"")


def _inflate(coding: str, data: bytes, max_out: int, piece: int = 7) -> bytes:
    """Feeds ``data`` in small pieces as a network would, like read_body does."""
    inflater, out = _Inflater(coding), b""
    for at in range(0, len(data), piece):
        out += inflater.feed(data[at : at + piece], max_out - len(out))
        if len(out) > max_out:
            return out
    inflater.finish()
    return out


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(
    ("coding", "compress"),
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),  # zlib-wrapped, as RFC 9110 means it
        ("deflate", _raw_deflate),  # as some clients send it
    ],
)
def test_codings_decode_in_pieces(coding, compress):
    data = json.dumps({"prompt": "hello " * 300}).encode()
    assert _inflate(coding, compress(data), 10_000) == data
    assert _inflate(coding, compress(data), 10_000, piece=1) == data


def test_gzip_members_concatenate():
    assert _inflate("gzip", gzip.compress(b"ab") + gzip.compress(b"cd"), 100) == b"abcd"


def test_bomb_stops_one_byte_past_the_cap():
    packer = zlib.compressobj()
    bomb = b"".join(packer.compress(bytes(1 << 20)) for _ in range(64)) + packer.flush()
    assert len(bomb) < 100_000  # 64 MiB of zeros
    out = _inflate("deflate", bomb, 4096, piece=len(bomb))
    assert len(out) == 4097


@pytest.mark.parametrize(
    ("coding", "data", "problem"),
    [
        ("gzip", b"not gzip at all", "incorrect header"),
        ("gzip", gzip.compress(b"x" * 100)[:-6], "truncated"),
        ("gzip", gzip.compress(b"x") + b"trailing", "after the end"),
        ("deflate", zlib.compress(b"x") + b"!", "after the end"),
        ("deflate", b"\xff\xff\xff\xff", "invalid"),
        ("gzip", b"", "empty"),
    ],
)
def test_invalid_compressed_data_is_400(coding, data, problem):
    with pytest.raises(RequestRefused) as info:
        _inflate(coding, data, 1000)
    assert info.value.status == 400 and info.value.code == "invalid_body_encoding"
    assert problem in info.value.message and info.value.close


async def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch):
    """Megabytes of small objects (120,000 empty chat messages) take hundreds of milliseconds to
    parse and check: not on the loop that serves everyone else."""
    import threading

    from common import json_body

    threads: list[str] = []
    real = json_body.parse_json

    def recorded(body: bytes):
        threads.append(threading.current_thread().name)
        return real(body)

    monkeypatch.setattr(json_body, "parse_json", recorded)
    small = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    large = json.dumps({"messages": [{"role": "user", "content": ""}] * 120_000}).encode()
    assert len(await json_body.parse_json_body(small)) == 1
    assert len((await json_body.parse_json_body(large))["messages"]) == 120_000
    loop_thread = threading.current_thread().name
    assert threads[0] == loop_thread and threads[1] != loop_thread
    deep = b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1)
    with pytest.raises(RequestRefused, match="deeper than"):
        await json_body.parse_json_body(deep + b" " * json_body.OFF_LOOP_BYTES)
