"""HTTP cases about everything but the body: Authorization and other headers of odd bytes and
shapes, heads no header list can express, odd request lines, bytes that are not HTTP, wrong
methods, unknown paths, the GET and admin endpoints, and the gateway's unavailable model."""

from __future__ import annotations

import json
import random

from scripts.fuzzer.bodies import BODIES, valid_bytes
from scripts.fuzzer.profile import CHAT, COMPLETIONS, Profile
from scripts.fuzzer.request import (
    Case,
    auth_headers,
    completion_request,
    post,
    replace_header,
    request_headers,
)
from scripts.fuzzer.values import EDGE_VALUES, to_json

_AUTH_VALUES: list[tuple[str, bytes | None]] = [
    ("missing", None),
    ("Bearer only", b"Bearer"),
    ("Bearer and spaces", b"Bearer    "),
    ("Basic", b"Basic Zm9vOmJhcg=="),
    ("wrong key", b"Bearer not-the-key"),
    ("lowercase scheme", b"bearer {key}"),
    ("valid key padded", b"Bearer   {key}   "),
    ("latin-1 byte", b"Bearer caf\xe9"),
    ("non-UTF-8 bytes", b"Bearer \xff\xfe\xfd"),
    ("UTF-8 Cyrillic", "Bearer ключ".encode()),
    ("control chars", b"Bearer a\x01b\x7f"),
    ("4000 bytes", b"Bearer " + b"k" * 4000),
    ("9000 bytes", b"Bearer " + b"k" * 9000),
    ("key with tab", b"Bearer\t{key}"),
]


def authorization(rng: random.Random, p: Profile) -> Case:
    path = rng.choice([CHAT, COMPLETIONS, "/v1/models", *p.admin_paths])
    body = valid_bytes(rng, p, path) if path in (CHAT, COMPLETIONS) else b""
    name, value = rng.choice(_AUTH_VALUES)
    key = (p.admin_key if path.startswith("/admin") else p.api_key) or "k"
    headers = [h for h in request_headers(p, path, body) if h[0] != b"Authorization"]
    if value is not None:
        headers.append((b"Authorization", value.replace(b"{key}", key.encode())))
    if rng.random() < 0.15:  # and a valid one as well: which of the two counts?
        headers += auth_headers(p, path)
        name += " plus a valid one"
    method = (
        "GET" if path in ("/v1/models", "/admin/backends", "/admin/prometheus/targets") else "POST"
    )
    if path.startswith("/admin") and method == "POST":
        body = b'{"drain": false}'  # a valid admin key must never drain the fleet under test
        headers = list(replace_header(headers, b"Content-Length", [str(len(body)).encode()]))
    return Case(f"http Authorization {name} on {path}", method, path, tuple(headers), body)


def odd_header(rng: random.Random, p: Profile) -> Case:
    path, body = completion_request(rng, p)
    variants: dict[str, list[tuple[bytes, bytes]]] = {
        "x-request-id non-UTF-8": [(b"X-Request-Id", b"\xff\xfe\x80")],
        "x-request-id 8000 bytes": [(b"X-Request-Id", b"r" * 8000)],
        "x-request-id UTF-8 emoji": [(b"X-Request-Id", "\U0001f600".encode())],
        "x-request-id control chars": [(b"X-Request-Id", b"a\x01\x02b")],
        "header value 9000 bytes": [(b"X-Big", b"v" * 9000)],
        "200 headers": [(b"X-H%d" % i, b"v") for i in range(200)],
        "non-ASCII header name": [("X-Ключ".encode(), b"v")],
        "header name with space": [(b"X Bad", b"v")],
        "empty header name": [(b"", b"v")],
        "Host twice": [(b"Host", b"evil.example")],
        "Host garbage": [(b"Host", b"\xff\x00:99999")],
        "Connection close": [(b"Connection", b"close")],
        "Upgrade h2c": [(b"Connection", b"Upgrade, HTTP2-Settings"), (b"Upgrade", b"h2c")],
        "Upgrade websocket": [(b"Connection", b"Upgrade"), (b"Upgrade", b"websocket")],
        "Accept-Encoding gzip": [(b"Accept-Encoding", b"gzip, br")],
        "Accept event-stream": [(b"Accept", b"text/event-stream")],
        "Range": [(b"Range", b"bytes=0-1")],
        "Cookie 4000 bytes": [(b"Cookie", b"a=" + b"c" * 4000)],
        "latin-1 header value": [(b"X-Name", b"Ren\xe9e")],
        "NUL in header value": [(b"X-Nul", b"a\x00b")],
        "Forwarded spoof": [(b"X-Forwarded-For", b"1.2.3.4, \xff"), (b"Forwarded", b'for="[::1]"')],
    }
    variant = rng.choice(sorted(variants))
    headers = list(request_headers(p, path, body)) + variants[variant]
    return Case(f"http header {variant}", "POST", path, tuple(headers), body)


def malformed_head(rng: random.Random, p: Profile) -> Case:
    """Heads no Case header list can express: written out byte by byte."""
    path, body = completion_request(rng, p)
    auth = b"".join(n + b": " + v + b"\r\n" for n, v in auth_headers(p, path))
    length = b"Content-Length: %d\r\n" % len(body)
    start = b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
    variants: dict[str, tuple[bytes, bool]] = {
        "header without colon": (
            start + b"NoColonHere\r\n" + auth + length + b"\r\n" + body,
            False,
        ),
        "obs-fold continuation": (
            start + b"X-A: 1\r\n  folded\r\n" + auth + length + b"\r\n" + body,
            False,
        ),
        "bare LF line ends": (
            (start + auth + length).replace(b"\r\n", b"\n") + b"\n" + body,
            False,
        ),
        "bare CR in header": (start + b"X-A: 1\r2\r\n" + auth + length + b"\r\n" + body, False),
        "space before colon": (start + b"Content-Length : 2\r\n" + auth + b"\r\n{}", False),
        "no Host": (
            b"POST " + path.encode() + b" HTTP/1.1\r\n" + auth + length + b"\r\n" + body,
            False,
        ),
        "unterminated head": (start + auth + length, True),
        "head cut mid-line": (start + b"X-Cut: abc", True),
        "pipelined garbage": (
            start + auth + length + b"\r\n" + body + b"\x16\x03\x01garbage\r\n\r\n",
            False,
        ),
        "two requests pipelined": ((start + auth + length + b"\r\n" + body) * 2, False),
    }
    variant = rng.choice(sorted(variants))
    raw, incomplete = variants[variant]
    return Case(f"http head {variant}", "POST", path, (), raw=raw, incomplete=incomplete)


def request_line(rng: random.Random, p: Profile) -> Case:
    path = rng.choice([CHAT, COMPLETIONS, "/v1/models"])
    auth = b"".join(n + b": " + v + b"\r\n" for n, v in auth_headers(p, path))
    tail = b"\r\nHost: x\r\n" + auth + b"Content-Length: 0\r\n\r\n"
    target = path.encode()
    variants: dict[str, tuple[bytes, bool]] = {
        "HTTP/1.0": (b"GET " + target + b" HTTP/1.0" + tail, False),
        "HTTP/2.0": (b"GET " + target + b" HTTP/2.0" + tail, False),
        "HTTP/1.2": (b"GET " + target + b" HTTP/1.2" + tail, False),
        "HTTP/9.9": (b"GET " + target + b" HTTP/9.9" + tail, False),
        "lowercase version": (b"GET " + target + b" http/1.1" + tail, False),
        "version junk": (b"GET " + target + b" HTTP/1.1x" + tail, False),
        "extra field": (b"GET " + target + b" HTTP/1.1 extra" + tail, False),
        "HTTP/0.9": (b"GET " + target + b"\r\n", True),
        "version HTTP/0.9": (b"GET " + target + b" HTTP/0.9" + tail, False),
        "absolute URI": (b"GET http://127.0.0.1" + target + b" HTTP/1.1" + tail, False),
        "asterisk target": (b"OPTIONS * HTTP/1.1" + tail, False),
        "non-ASCII target": (b"GET /v1/\xff\xfe HTTP/1.1" + tail, False),
        "space in target": (b"GET /v1/ch at HTTP/1.1" + tail, False),
        "9000-byte target": (b"GET /" + b"a" * 9000 + b" HTTP/1.1" + tail, False),
        "lowercase method": (b"post " + target + b" HTTP/1.1" + tail, False),
        "non-ASCII method": (b"P\xffST " + target + b" HTTP/1.1" + tail, False),
        "1000-byte method": (b"X" * 1000 + b" " + target + b" HTTP/1.1" + tail, False),
        "CONNECT": (b"CONNECT 127.0.0.1:443 HTTP/1.1" + tail, False),
        "tab separators": (b"GET\t" + target + b"\tHTTP/1.1" + tail, False),
        "leading empty lines": (b"\r\n\r\nGET " + target + b" HTTP/1.1" + tail, False),
    }
    variant = rng.choice(sorted(variants))
    raw, incomplete = variants[variant]
    may_close = variant == "HTTP/0.9"
    return Case(
        f"http request line {variant}",
        "GET",
        path,
        (),
        raw=raw,
        incomplete=incomplete,
        may_close=may_close,
    )


def not_http(rng: random.Random, p: Profile) -> Case:
    variants: dict[str, bytes] = {
        "random bytes": rng.randbytes(rng.randint(1, 512)),
        "TLS ClientHello": bytes.fromhex("160301002a0100002603035f") + rng.randbytes(40),
        "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00",
        "SSH banner": b"SSH-2.0-OpenSSH_9.6\r\n",
        "NUL bytes": b"\x00" * 256,
        "only CRLFs": b"\r\n" * 64,
    }
    variant = rng.choice(sorted(variants))
    # A server may wait for a request to start after blank lines, or close on noise.
    return Case(
        f"http not HTTP: {variant}", "GET", "/", (), raw=variants[variant], may_close=True,
        incomplete=variant == "only CRLFs",
    )  # fmt: skip


def odd_method(rng: random.Random, p: Profile) -> Case:
    path = rng.choice([CHAT, COMPLETIONS, *p.tokenizer_paths, *p.get_paths, *p.admin_paths])
    method = rng.choice(
        ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "HEAD", "FOO", "POST"]
    )
    body = valid_bytes(rng, p, path) if path in BODIES and rng.random() < 0.5 else b""
    if path in ("/admin/drain", "/admin/reload"):
        body = b'{"drain": false}'  # never drain or reload the fleet under test
    headers = request_headers(p, path, body)
    if path == "/admin/reload":
        headers = list(replace_header(headers, b"Authorization", [b"Bearer wrong"]))
    return Case(f"http method {method} {path}", method, path, tuple(headers), body)


_UNKNOWN_PATHS = [
    "/", "/v2/chat/completions", "/v1/chat/completions/", "//v1/chat/completions",
    "/v1/chat/completions?stream=true&x=%ff", "/v1/chat%2Fcompletions", "/%ff%fe",
    "/v1/models/../models", "/v1/models/m1", "/v1/embeddings", "/v1/responses",
    "/v1/chat/completions;x=1", "/admin", "/admin/", "/metrics?name[]=x", "/.env",
    "/v1/models?limit=-1", "/health/../ready", "/v1/completions%00", "/" + "a/" * 2000,
]  # fmt: skip


def unknown_path(rng: random.Random, p: Profile) -> Case:
    path = rng.choice(_UNKNOWN_PATHS)
    method = rng.choice(["GET", "POST"])
    body = valid_bytes(rng, p, CHAT) if method == "POST" else b""
    return Case(f"http path {path[:40]}", method, path, tuple(request_headers(p, path, body)), body)


def get_endpoint(rng: random.Random, p: Profile) -> Case:
    path = rng.choice([*p.get_paths, *p.admin_paths])
    if path in ("/admin/drain", "/admin/reload"):
        return _admin_post(rng, p, path)
    query = rng.choice(["", "?external=true", "?x=%ff%fe", "?" + "a=1&" * 500, "?external=\x00"])
    body = rng.choice([b"", b"", b"{}", b"\xff"])
    target = path + query.replace("\x00", "%00")
    return Case(f"http GET {path}", "GET", target, tuple(request_headers(p, path, body)), body)


def _admin_post(rng: random.Random, p: Profile, path: str) -> Case:
    """The mutating admin endpoints get the valid admin key only with bodies that leave the fleet
    as it is (no reload, no drain); the rest of the time a wrong key and any body."""
    name, make = rng.choice(EDGE_VALUES)
    if path == "/admin/drain" and rng.random() < 0.6:
        field = rng.choice(["backend", "model"])
        body = to_json({"backend": "127.0.0.1:1", "drain": False, field: make(p)}, True)
        label = f"http POST /admin/drain (admin key) {field} <- {name}"
        return post(p, path, body, label=label)
    body = to_json({"drain": make(p)}, True)
    headers = replace_header(request_headers(p, path, body), b"Authorization", [b"Bearer wrong"])
    return Case(f"http POST {path} (wrong key) drain <- {name}", "POST", path, headers, body)


def unavailable_model(rng: random.Random, p: Profile) -> Case:
    """A valid request for the gateway's model whose upstream is down (the engine: a valid one)."""
    path = rng.choice([CHAT, COMPLETIONS])
    body = BODIES[path](rng, p)
    body["model"] = p.unavailable_model or p.model
    data = json.dumps(body).encode()
    return post(
        p,
        path,
        data,
        label=f"http valid request for model {body['model']}",
        unavailable_ok=bool(p.unavailable_model),
    )
