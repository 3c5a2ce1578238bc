"""HTTP cases about the body's transport: Content-Encoding (valid, invalid, truncated, bombs),
Content-Length and chunked framing errors, Transfer-Encoding, Expect, Content-Type, and a body
over the limit."""

from __future__ import annotations

import functools
import gzip
import json
import random
import zlib
from collections.abc import Callable

from scripts.fuzzer.profile import BODY_LIMIT, CHAT, COMPLETIONS, Profile
from scripts.fuzzer.request import (
    Case,
    completion_request,
    post,
    replace_header,
    request_headers,
)

_BOMB_BYTES = 32 * 2**20  # what a zip bomb inflates to: 8x the body limit, from ~32 KB


@functools.cache
def _bomb(coding: str, model: str) -> bytes:
    """A body that inflates to _BOMB_BYTES: a valid request whose content is that many spaces."""
    text = b'{"model":"' + model.encode() + b'","prompt":"' + b" " * _BOMB_BYTES + b'"}'
    return _compress(coding, text, level=9)


def _compress(coding: str, data: bytes, level: int = 6) -> bytes:
    if coding == "gzip":
        return gzip.compress(data, compresslevel=level, mtime=0)
    if coding == "deflate":
        return zlib.compress(data, level)
    raw = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
    return raw.compress(data) + raw.flush()


def encoded_body(rng: random.Random, p: Profile) -> Case:
    path, plain = completion_request(rng, p)
    coding = rng.choice(["gzip", "deflate", "raw deflate"])
    header = b"deflate" if coding == "raw deflate" else coding.encode()
    packed = _compress(coding, plain)
    variants: dict[str, Callable[[], bytes]] = {
        "valid": lambda: packed,
        "invalid": lambda: rng.randbytes(rng.randint(1, 200)),
        "truncated": lambda: packed[: rng.randrange(1, len(packed))],
        "trailing garbage": lambda: packed + b"garbage",
        "two members": lambda: packed + packed,
        "plain body": lambda: plain,
        "empty": lambda: b"",
        "bomb": lambda: _bomb(coding, p.model),
        "compressed twice": lambda: _compress(coding, packed),
    }
    variant = rng.choice(sorted(variants))
    body = variants[variant]()
    headers = replace_header(request_headers(p, path, body), b"Content-Encoding", [header])
    return Case(f"http Content-Encoding {coding}: {variant}", "POST", path, headers, body)


def odd_encoding(rng: random.Random, p: Profile) -> Case:
    path, plain = completion_request(rng, p)
    value = rng.choice(
        [b"br", b"zstd", b"compress", b"unknown", b"gzip, deflate", b"identity", b"", b"GZIP",
         b"x-gzip", b"gzip;q=1", b"\xff\xfe", b"chunked"]
    )  # fmt: skip
    body = _compress("gzip", plain) if value.lower() in (b"gzip", b"x-gzip") else plain
    headers = replace_header(request_headers(p, path, body), b"Content-Encoding", [value])
    return Case(f"http Content-Encoding {value!r}", "POST", path, headers, body)


def content_length(rng: random.Random, p: Profile) -> Case:
    path, body = completion_request(rng, p)
    n = len(body)
    variants: dict[str, tuple[list[bytes], bool]] = {
        "smaller than body": ([str(n // 2).encode()], False),
        "larger than body": ([str(n + 100).encode()], True),
        "zero": ([b"0"], False),
        "negative": ([b"-1"], False),
        "plus sign": ([b"+" + str(n).encode()], False),
        "hex": ([hex(n).encode()], False),
        "not a number": ([b"abc"], False),
        "empty": ([b""], False),
        "spaces around": ([b"  " + str(n).encode() + b"  "], False),
        "list": ([str(n).encode() + b", " + str(n).encode()], False),
        "twice, equal": ([str(n).encode(), str(n).encode()], False),
        "twice, different": ([str(n).encode(), str(n + 1).encode()], False),
        "20 digits": ([b"9" * 20], True),
        "over the body limit": ([str(BODY_LIMIT * 4).encode()], True),
        "leading zeros": ([b"000" + str(n).encode()], False),
    }
    variant = rng.choice(sorted(variants))
    values, incomplete = variants[variant]
    headers = replace_header(request_headers(p, path, body), b"Content-Length", values)
    return Case(
        f"http Content-Length {variant}", "POST", path, headers, body, incomplete=incomplete
    )


def _chunks(rng: random.Random, body: bytes) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(body)), min(3, len(body) - 1)))
    return [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]


def chunked_body(rng: random.Random, p: Profile) -> Case:
    path, body = completion_request(rng, p)
    parts = _chunks(rng, body)
    framed = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in parts)
    variants: dict[str, tuple[bytes, bool]] = {
        "valid": (framed + b"0\r\n\r\n", False),
        "with trailers": (framed + b"0\r\nX-Trailer: 1\r\n\r\n", False),
        "with extensions": (framed.replace(b"\r\n", b";ext=1\r\n", 1) + b"0\r\n\r\n", False),
        "bad size": (b"zz\r\n" + body + b"\r\n0\r\n\r\n", False),
        "negative size": (b"-5\r\n" + body + b"\r\n0\r\n\r\n", False),
        "size 0x prefix": (b"0x10\r\n" + body[:16] + b"\r\n0\r\n\r\n", False),
        "size overflows 64 bits": (b"f" * 20 + b"\r\n" + body + b"\r\n0\r\n\r\n", False),
        "size larger than data": (b"%x\r\n" % (len(body) + 50) + body + b"\r\n0\r\n\r\n", True),
        "size smaller than data": (b"%x\r\n" % (len(body) // 2) + body + b"\r\n0\r\n\r\n", False),
        "no final chunk": (framed, True),
        "missing CRLF after data": (b"%x\r\n" % len(body) + body + b"0\r\n\r\n", False),
        "bare LF": (framed.replace(b"\r\n", b"\n") + b"0\n\n", False),
        "non-ASCII extension": (b"%x;\xff\xfe\r\n" % len(body) + body + b"\r\n0\r\n\r\n", False),
        "over the body limit": (b"%x\r\n" % (BODY_LIMIT + 1) + b" " * (BODY_LIMIT + 1), True),
    }
    variant = rng.choice(sorted(variants))
    data, incomplete = variants[variant]
    te = rng.choice([b"chunked"] * 4 + [b"CHUNKED", b"gzip, chunked", b"chunked, identity"])
    headers = [h for h in request_headers(p, path, body) if h[0] != b"Content-Length"]
    if rng.random() < 0.15:  # both framings: a request smuggling classic
        headers.append((b"Content-Length", str(len(body)).encode()))
    headers.append((b"Transfer-Encoding", te))
    label = f"http chunked {variant}"
    return Case(label, "POST", path, tuple(headers), data, incomplete=incomplete)


def odd_transfer_encoding(rng: random.Random, p: Profile) -> Case:
    path, body = completion_request(rng, p)
    value = rng.choice([b"identity", b"xchunked", b"chunked ", b"gzip", b"", b"\xffchunked"])
    headers = replace_header(request_headers(p, path, body), b"Transfer-Encoding", [value])
    return Case(f"http Transfer-Encoding {value!r}", "POST", path, headers, body)


def expect(rng: random.Random, p: Profile) -> Case:
    path, body = completion_request(rng, p)
    value = rng.choice(
        [b"100-continue", b"100-Continue", b"200-ok", b"", b"100-continue, foo", b"\xff"]
    )
    headers = [*request_headers(p, path, body), (b"Expect", value)]
    label = f"http Expect {value!r}"
    if rng.random() < 0.3:  # a declared body over the limit, not sent: 413 before 100 Continue
        headers = list(replace_header(headers, b"Content-Length", [str(BODY_LIMIT * 2).encode()]))
        return Case(
            label + " with a body over the limit",
            "POST",
            path,
            tuple(headers),
            b"",
            incomplete=True,
        )
    return Case(label, "POST", path, tuple(headers), body)


def content_type(rng: random.Random, p: Profile) -> Case:
    path, body = completion_request(rng, p)
    value = rng.choice(
        [None, b"text/plain", b"application/x-www-form-urlencoded",
         b"multipart/form-data; boundary=x", b"application/json; charset=utf-16",
         b"application/json; charset=latin-1", b"\xff\xfe/\x00",
         b"application/json" + b"; x=y" * 1000, b"*/*", b"application/json, text/plain"]
    )  # fmt: skip
    headers = list(request_headers(p, path, body))
    headers = [h for h in headers if h[0] != b"Content-Type"]
    if value is not None:
        headers.append((b"Content-Type", value))
    return Case(f"http Content-Type {value!r:.60}", "POST", path, tuple(headers), body)


def body_over_limit(rng: random.Random, p: Profile) -> Case:
    path = rng.choice([CHAT, COMPLETIONS])
    content = "x" * (BODY_LIMIT + rng.choice([1, 1000]))
    body = json.dumps(
        {"model": p.model, "prompt": content, "messages": [{"role": "user", "content": "a"}]}
    )
    return post(p, path, body.encode(), label="http body over the limit")
