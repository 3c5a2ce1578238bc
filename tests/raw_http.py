"""Raw HTTP exchanges for the parser-level error tests of both servers (engine and gateway):
bytes go out as they are, which no client library would send."""

from __future__ import annotations

import asyncio
import json


async def raw_exchange(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Sends bytes as they are (no client library tidies them up) and reads one answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)  # the server closes after an error
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


def assert_openai_error(headers: dict[str, str], body: bytes, code: str) -> None:
    """A client error in the OpenAI shape, on a connection the server closes."""
    assert headers["content-type"].startswith("application/json")
    assert headers.get("connection", "").lower() == "close"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["type"] == "invalid_request_error"
