"""A real headless Chromium driven over the Chrome DevTools Protocol, for the dashboard test.

Why our own small client: the protocol is JSON over one WebSocket (`websockets` comes with
uvicorn[standard]), and Playwright's driver would add a dependency whose own browser download
cannot work here. The browser is Debian's `chromium`, started with a fresh profile and with
background networking, component updates and sync off, so every request it makes is the page's.

`Browser.start()` launches it and attaches to one page; the page's script errors, console
errors, log errors and every network request are collected as they happen, for the test to
assert on. `close()` ends the process and removes the profile.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websockets

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
    "--disable-default-apps", "--disable-extensions", "--mute-audio",
    "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
)
CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageLog:
    """What the page did: script exceptions, console/log errors, and requested URLs."""

    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def note(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"exception: {text}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = [a.get("value", a.get("description")) for a in params.get("args", [])]
            self.errors.append(f"console.{params.get('type')}: {args}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log ({entry.get('source')}): {entry.get('text')} "
                               f"{entry.get('url', '')}")
        elif method == "Network.requestWillBeSent":
            self.requests.append(params.get("request", {}).get("url", ""))


class Browser:
    """One headless Chromium with one attached page (`session`)."""

    def __init__(self, executable: str) -> None:
        self._executable = executable
        self._profile = Path(tempfile.mkdtemp(prefix="hedge-chromium-"))
        self._process: subprocess.Popen[bytes] | None = None
        self._ws: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._session: str | None = None
        self.log = PageLog()

    async def start(self, timeout: float = 30.0) -> None:
        self._process = subprocess.Popen(
            [self._executable, *FLAGS, f"--user-data-dir={self._profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        port_file = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not port_file.exists() or len(port_file.read_text().splitlines()) < 2:
            if self._process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self._process.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not open its DevTools port")
            await asyncio.sleep(0.05)
        port, path = port_file.read_text().splitlines()[:2]
        self._ws = await websockets.connect(
            f"ws://127.0.0.1:{port}{path}", max_size=64 * 1024 * 1024, open_timeout=timeout
        )
        self._reader = asyncio.create_task(self._read())
        target = await self.call("Target.createTarget", {"url": "about:blank"}, browser=True)
        attached = await self.call(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True},
            browser=True,
        )
        self._session = attached["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            await self.call(f"{domain}.enable")

    async def _read(self) -> None:
        async for raw in self._ws:
            message = json.loads(raw)
            if "id" in message:
                future = self._pending.pop(message["id"], None)
                if future is not None and not future.done():
                    future.set_result(message)
            elif message.get("sessionId") == self._session:
                self.log.note(message.get("method", ""), message.get("params", {}))

    async def call(self, method: str, params: dict[str, Any] | None = None, *,
                   browser: bool = False, timeout: float = 30.0) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method,
                                   "params": params or {}}
        if not browser:
            message["sessionId"] = self._session
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        await self._ws.send(json.dumps(message))
        reply = await asyncio.wait_for(future, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    async def evaluate(self, expression: str) -> Any:
        reply = await self.call("Runtime.evaluate", {"expression": expression,
                                                     "returnByValue": True})
        if "exceptionDetails" in reply:
            raise RuntimeError(f"evaluate {expression!r}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        """Poll a JS expression until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still falsy after {timeout} s: {expression}")
            await asyncio.sleep(0.1)

    async def screenshot(self, path: Path, width: int, height: int) -> None:
        await self.call("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        shot = await self.call("Page.captureScreenshot", {"format": "png"})
        path.write_bytes(base64.b64decode(shot["data"]))

    async def close(self) -> None:
        if self._ws is not None:
            with contextlib.suppress(RuntimeError, TimeoutError, websockets.ConnectionClosed):
                await self.call("Browser.close", browser=True, timeout=5.0)
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, websockets.ConnectionClosed):
                await self._reader
        if self._process is not None:
            if self._process.poll() is None:
                self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(10)
        shutil.rmtree(self._profile, ignore_errors=True)
