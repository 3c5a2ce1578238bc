"""Reading a request body under a size limit that holds for what the body *decodes* to, and a
deadline for the whole body.

The servers run aiohttp with ``auto_decompress=False``: aiohttp would inflate a compressed body
before any limit applied (a 1 MB deflate body became 1 GiB). Here the raw bytes and the decoded
bytes are both counted as they arrive, and inflating stops one byte past ``max_bytes``, so a zip
bomb costs at most the limit. Codings: ``identity``, ``gzip`` (several members allowed, as RFC 1952
does) and ``deflate`` (zlib-wrapped as RFC 9110 says, or raw, as some clients send it).
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any, Protocol

from aiohttp import web

from common.errors import RequestRefused

_GZIP_MAGIC = b"\x1f\x8b"
_IDENTITY = ("", "identity")


class _Decoder(Protocol):
    def feed(self, data: bytes, max_out: int) -> bytes: ...
    def finish(self) -> None: ...


class _Inflater:
    """Streaming gzip/deflate with an output cap per call. ``max_out`` + 1 bytes at most come
    out of one call, so the caller sees the limit passed without inflating further."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self._inflate: Any = None  # a zlib decompressor, made on a member's first bytes
        self._started = False
        self._head = b""  # deflate's first byte, until the second tells zlib from raw

    def _new(self, first: bytes) -> Any:
        if self.coding == "gzip":
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        # A zlib stream starts with a CMF/FLG pair whose 16-bit value is a multiple of 31.
        zlib_wrapped = (
            len(first) >= 2 and first[0] & 0x0F == 8 and (first[0] << 8 | first[1]) % 31 == 0
        )
        return zlib.decompressobj(zlib.MAX_WBITS if zlib_wrapped else -zlib.MAX_WBITS)

    def feed(self, data: bytes, max_out: int) -> bytes:
        if not self._started and self.coding == "deflate" and len(self._head + data) < 2:
            self._head += data
            return b""
        data, self._head = self._head + data, b""
        out = bytearray()
        while data:
            if self._inflate is None:
                if self._started and not (
                    self.coding == "gzip" and data.startswith(_GZIP_MAGIC[: len(data)])
                ):
                    raise _bad_encoding(self.coding, "data after the end of the compressed stream")
                self._inflate = self._new(data)
                self._started = True
            inflate = self._inflate
            try:
                out += inflate.decompress(data, max_out - len(out) + 1)
            except zlib.error as exc:
                raise _bad_encoding(self.coding, str(exc)) from None
            if len(out) > max_out:  # stopped at the cap: whatever is left is past the limit
                return bytes(out)
            if not inflate.eof:
                break
            data = inflate.unused_data
            self._inflate = None  # what follows must be another gzip member
        return bytes(out)

    def finish(self) -> None:
        if not self._started and not self._head:
            raise _bad_encoding(self.coding, "the body is empty")
        if self._inflate is not None or self._head:
            raise _bad_encoding(self.coding, "the compressed stream is truncated")


def _bad_encoding(coding: str, problem: str) -> RequestRefused:
    return RequestRefused(
        400,
        f"Request body is not valid {coding} data: {problem}.",
        "invalid_body_encoding",
        close=True,
    )


def _decoder(request: web.BaseRequest) -> _Decoder | None:
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    if coding in _IDENTITY:
        return None
    if coding in ("gzip", "x-gzip"):
        return _Inflater("gzip")
    if coding == "deflate":
        return _Inflater("deflate")
    raise RequestRefused(
        415,
        "Unsupported Content-Encoding: send the body as identity, gzip or deflate.",
        "unsupported_content_encoding",
        headers={"Accept-Encoding": "gzip, deflate"},
        close=True,
    )


def too_large(max_bytes: int) -> RequestRefused:
    return RequestRefused(
        413,
        f"Request body is larger than {max_bytes} bytes (after decompression).",
        "body_too_large",
        close=True,
    )


def body_timed_out(timeout_s: float) -> RequestRefused:
    return RequestRefused(
        408,
        f"The request body did not arrive within {timeout_s:g} s.",
        "request_timeout",
        close=True,
    )


async def read_body(request: web.BaseRequest, max_bytes: int, timeout_s: float) -> bytes:
    """The decoded body; RequestRefused 413 as soon as the raw or the decoded size passes
    ``max_bytes`` (from Content-Length before reading anything), 408 when the whole body has not
    arrived within ``timeout_s``, 400/415 for a body that does not decode."""
    decoder = _decoder(request)
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large(max_bytes)
    chunks: list[bytes] = []
    raw_size = size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_any():
                raw_size += len(chunk)
                if decoder is not None:
                    chunk = decoder.feed(chunk, max_bytes - size)
                size += len(chunk)
                if raw_size > max_bytes or size > max_bytes:
                    raise too_large(max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise body_timed_out(timeout_s) from None
    except web.RequestPayloadError as exc:  # bad chunked framing, or the body was cut short
        raise RequestRefused(
            400, f"Malformed request body: {exc}.", "invalid_body", close=True
        ) from None
    if decoder is not None:
        decoder.finish()
    return b"".join(chunks)
