"""Headless Chromium driven over the Chrome DevTools Protocol, for the status page's test (and
scripts that want a screenshot of it): a browser of its own (a fresh profile in a folder of the
caller's), one page reached through the browser's ``--remote-debugging-port`` and a websocket
(aiohttp), and what a test needs of it: open a URL, evaluate JavaScript, wait for a condition,
take a screenshot; and the page's uncaught exceptions and console errors (a script the CSP
blocked shows there). Debian's ``chromium`` (``make chromium`` installs it): Playwright's own
browser download needs a network this project may not have.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

from common.processes import alive, descendants, stop_process

START_TIMEOUT_S = 30.0
COMMAND_TIMEOUT_S = 15.0


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class ChromiumError(RuntimeError):
    """The browser did not start, or a command failed (a script's exception included)."""


class Chromium:
    """``async with Chromium(folder) as page``: a headless browser and its first page."""

    def __init__(self, folder: Path, width: int = 1280, height: int = 900) -> None:
        self.folder = folder
        self.size = (width, height)
        self.proc: subprocess.Popen[bytes] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._answers: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.errors: list[str] = []  # the page's uncaught exceptions and console errors

    async def __aenter__(self) -> Chromium:
        binary = chromium_binary()
        if binary is None:
            raise ChromiumError("no chromium on PATH: run `make chromium`")
        profile = self.folder / "profile"
        profile.mkdir(parents=True, exist_ok=True)
        command = [
            binary, "--headless=new", "--disable-gpu", "--no-first-run",
            "--no-default-browser-check", "--disable-extensions",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--remote-debugging-port=0", f"--user-data-dir={profile}",
            f"--window-size={self.size[0]},{self.size[1]}",
        ]  # fmt: skip
        if os.geteuid() == 0:
            command.append("--no-sandbox")  # Chromium refuses root with its sandbox
        command.append("about:blank")
        with open(self.folder / "chromium.log", "wb") as log:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        try:
            await self._connect(profile / "DevToolsActivePort")
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _connect(self, port_file: Path) -> None:
        """The port it listens on is written to its profile once it does; then its page."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists() or not port_file.read_text().strip():
            assert self.proc is not None
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.folder / "chromium.log").read_text(errors="replace")[-2000:]
                raise ChromiumError(f"chromium did not start: {log}")
            await asyncio.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json()
        page = next(t for t in targets if t.get("type") == "page")
        self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        for domain in ("Page", "Runtime", "Log"):
            await self.send(f"{domain}.enable")

    async def _read(self) -> None:
        """Hands each answer to its command, and keeps the errors the page reports."""
        assert self._ws is not None
        async for message in self._ws:
            if message.type is not aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(message.data)
            self._note_error(data)
            answer = self._answers.pop(data.get("id"), None)
            if answer is not None and not answer.done():
                answer.set_result(data)
        for answer in self._answers.values():
            if not answer.done():
                answer.set_exception(ChromiumError("the browser closed its connection"))

    def _note_error(self, event: dict[str, Any]) -> None:
        params = event.get("params", {})
        if event.get("method") == "Runtime.exceptionThrown":
            self.errors.append(json.dumps(params.get("exceptionDetails", {}))[:2000])
        elif event.get("method") == "Log.entryAdded":
            entry = params["entry"]
            # a refused fetch logs its status as a network error: the page handles those
            if entry.get("level") == "error" and entry.get("source") != "network":
                self.errors.append(entry.get("text", "")[:2000])

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        command_id = next(self._ids)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._answers[command_id] = answer
        await self._ws.send_str(json.dumps({"id": command_id, "method": method, "params": params}))
        data = await asyncio.wait_for(answer, COMMAND_TIMEOUT_S)
        if "error" in data:
            raise ChromiumError(f"{method}: {data['error']}")
        return data.get("result", {})

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    async def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (awaited when it is a promise)."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise ChromiumError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 10.0) -> Any:
        """Polls ``expression`` until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not true after {timeout_s}s: {expression}")
            await asyncio.sleep(0.1)

    async def screenshot(self, path: Path) -> Path:
        """The page as a PNG at ``path``, at its full height."""
        height = await self.evaluate("document.documentElement.scrollHeight")
        await self.send(
            "Emulation.setDeviceMetricsOverride", width=self.size[0],
            height=max(self.size[1], int(height)), deviceScaleFactor=1, mobile=False,
        )  # fmt: skip
        shot = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._reader, 5)
        if self._session is not None:
            await self._session.close()
        if self.proc is not None:
            helpers = descendants(self.proc.pid)  # its renderers and zygotes, by pid
            await asyncio.to_thread(stop_process, self.proc, 10)
            for pid in helpers:
                if alive(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
