"""ASGI apps (the gateway, the simulator, a test app) under a real uvicorn on loopback.

Why a real server: in-memory ASGI transports buffer whole responses, which hides exactly the
streaming behaviour (first token, cancellation) the tests are about.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass

import httpx
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send


class _ThreadFriendlyServer(uvicorn.Server):
    """uvicorn.Server that never installs signal handlers (the test runner owns SIGINT and
    pytest-timeout's SIGALRM) and tells when it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()


class StartupFailed(RuntimeError):
    """The ASGI app's lifespan startup failed (uvicorn would have called sys.exit)."""


@dataclass(frozen=True)
class RunningServer:
    """An ASGI app listening on 127.0.0.1. `base_url` is the root (no `/v1`)."""

    base_url: str
    port: int
    stop: Callable[[], Awaitable[None]]
    server: uvicorn.Server

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def v1(self) -> str:
        """The OpenAI-style base URL for SDK clients."""
        return self.base_url + "/v1"


async def serve_asgi(
    app: ASGIApp,
    *,
    host: str = "127.0.0.1",
    startup_timeout: float = 10.0,
    graceful_timeout: int = 2,
) -> RunningServer:
    """Run `app` under uvicorn (lifespan on) on a socket bound to an ephemeral port; return
    once it accepts connections. `await running.stop()` shuts it down gracefully (connections
    still streaming after `graceful_timeout` s are cut) and waits for it; it is idempotent."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    port: int = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level="warning",
        log_config=None,
        access_log=False,
        ws="none",
        proxy_headers=False,
        timeout_graceful_shutdown=graceful_timeout,
    )
    server = _ThreadFriendlyServer(config)
    serve_task = asyncio.create_task(_serve(server, sock), name=f"uvicorn-{port}")
    ready = asyncio.create_task(server.ready.wait(), name=f"uvicorn-{port}-ready")
    await asyncio.wait(
        {serve_task, ready}, timeout=startup_timeout, return_when=asyncio.FIRST_COMPLETED
    )

    async def stop(timeout: float = 10.0) -> None:
        if not serve_task.done():
            server.should_exit = True
            await asyncio.wait({serve_task}, timeout=timeout)
        if not serve_task.done():
            server.force_exit = True
            serve_task.cancel()
            await asyncio.wait({serve_task}, timeout=2.0)
        # Connections whose tasks uvicorn cancelled at the graceful timeout keep their sockets.
        for conn in list(server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if isinstance(transport, asyncio.BaseTransport):
                transport.close()
        if serve_task.done() and not serve_task.cancelled():
            serve_task.result()

    if not ready.done():
        ready.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ready
        if serve_task.done():
            serve_task.result()  # raises StartupFailed
        await stop()
        raise TimeoutError(f"ASGI app did not start within {startup_timeout}s")
    return RunningServer(f"http://{host}:{port}", port, stop, server)


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:  # uvicorn's way to report a failed lifespan startup
        raise StartupFailed(f"ASGI app failed to start (exit status {exc.code})") from None
    finally:
        sock.close()


async def wait_for_sim_stats(base: str, key: str, value: int) -> dict[str, int]:
    """The simulator's `/sim/stats` once `key` reached `value`: a bounded wait for the server
    to notice (a disconnect, say), not a timing assertion."""
    async with httpx.AsyncClient(base_url=base) as http:
        for _ in range(500):
            stats: dict[str, int] = (await http.get("/sim/stats")).json()
            if stats[key] == value:
                return stats
            await asyncio.sleep(0.01)
    raise AssertionError(f"{key} never reached {value}: {stats}")


def with_request_headers(app: ASGIApp, headers: dict[str, str]) -> ASGIApp:
    """`app`, seeing `headers` on every HTTP request as if the client had sent them: a
    simulator behind the gateway gets its per-request fault headers (`x-sim-break-at`...),
    which the gateway never forwards."""
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope = {**scope, "headers": [*scope["headers"], *extra]}
        await app(scope, receive, send)

    return wrapped
