"""Cloud credentials kept fresh off the request path: `Refresher`.

Why: the cloud SDKs' credential calls block. A Google token fetch is an HTTPS round trip (a JWT
grant at the service account's `token_uri`, or a call to the metadata server); botocore's chain
reads files and may call STS or the container endpoint. Made on the event loop, one of them
would stall every stream the gateway relays; made on the request path, it would add its round
trip to a request's time to first token. So a `Refresher` runs the blocking fetch in a worker
thread, from a task of its own, and schedules the next fetch ahead of the credential's expiry:
a request only reads the cached value. A value without a lifetime (`Fetched.lifetime` None:
static keys) never expires and is not fetched again unless the upstream refuses it
(`invalidate`); a temporary credential must come with its real lifetime, so that it is
refreshed ahead of its expiry however long the backend sat idle.

Life cycle: started lazily by the first `get()` (a provider has no start-up hook, and a backend
that is never used should not fetch anything), stopped by `aclose()`. A refresher whose value
nobody read since its last fetch stops refreshing (a backend dropped by a reload, or an idle
one, stops calling its token endpoint); the next `get()` starts it again: in the background
when the value is still good but due for its refresh, else waiting for that one fetch. A
failed fetch is retried with a growing pause; meanwhile a still valid value keeps serving,
and a request that finds none fails at once with `UpstreamCredentialsUnavailable` (another
backend may serve it) rather than waiting for the retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from gateway.errors import UpstreamCredentialsUnavailable

T = TypeVar("T")

#: refresh this long before expiry (or half the lifetime, for credentials shorter than twice it)
REFRESH_AHEAD = 300.0
#: a value this close to its expiry is no longer handed out: a request may take that long to
#: reach the upstream, which must still accept it
SAFETY = 10.0
#: first and longest pause after a failed fetch
RETRY_MIN = 1.0
RETRY_MAX = 30.0


@dataclass(frozen=True, slots=True)
class Fetched(Generic[T]):
    """One fetch's result: the value and, when known, its lifetime in seconds from now."""

    value: T
    lifetime: float | None


class Refresher(Generic[T]):
    """A credential fetched by `fetch` (blocking; run in a worker thread), cached, refreshed
    ahead of its expiry by a task of its own. `fetch` raises anything to say it failed: the
    exception is kept for `get()`'s message by its class name only (its text may hold a
    token endpoint's answer)."""

    def __init__(
        self,
        fetch: Callable[[], Fetched[T]],
        *,
        what: str,
        clock: Callable[[], float] = time.monotonic,
        min_interval: float = RETRY_MIN,
    ) -> None:
        self._fetch = fetch
        #: the shortest wait between two fetches (the first pause after a failure too)
        self._min_interval = min_interval
        self._what = what
        self._clock = clock
        self._value: T | None = None
        #: monotonic time after which the value is not handed out (None: never expires)
        self._good_until: float | None = None
        #: monotonic time from which the value is due for its refresh (None: never)
        self._refresh_at: float | None = None
        self._error: str | None = None
        #: set when a fetch ended (with a value or an error); cleared when one starts
        self._settled = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: `get()` read the value since the last fetch (else the next refresh is skipped)
        self._used = False
        #: a fetch is running in its worker thread
        self._fetching = False
        self._closed = False
        #: fetches made so far (tests and stats read it)
        self.fetches = 0

    def _fresh(self, now: float | None = None) -> bool:
        if self._value is None:
            return False
        return self._good_until is None or (
            self._clock() if now is None else now) < self._good_until

    async def get(self) -> T:
        """The current value; waits only when there is no good one (the first fetch, or the
        first after an idle gap longer than the value's lifetime). A good value due for its
        refresh, with no refresh running (it stopped while idle), starts one in the background.
        Raises `UpstreamCredentialsUnavailable`."""
        if self._closed:
            raise UpstreamCredentialsUnavailable(f"{self._what}: the backend is closed")
        self._used = True
        now = self._clock()
        if self._fresh(now):
            assert self._value is not None
            if self._refresh_at is not None and now >= self._refresh_at and (
                    self._task is None or self._task.done()):
                self._task = asyncio.create_task(self._run(), name=f"refresh-{self._what}")
            return self._value
        task = self._task
        if task is not None and not task.done() and not self._fetching:
            if self._error is not None:
                # pausing after a failure: say so now rather than wait for the retry
                raise UpstreamCredentialsUnavailable(f"{self._what}: {self._error}")
            task.cancel()  # asleep past the value's expiry (a stalled loop): fetch now
            task = None
        if task is None or task.done():
            self._settled.clear()
            self._task = asyncio.create_task(self._run(), name=f"refresh-{self._what}")
        await self._settled.wait()
        self._used = True
        if self._fresh():
            assert self._value is not None
            return self._value
        raise UpstreamCredentialsUnavailable(f"{self._what}: {self._error or 'expired'}")

    async def _run(self) -> None:
        """Fetch, then sleep until the next refresh is due, while someone reads the value."""
        pause = self._min_interval
        while True:
            fetched = await self._fetch_once()
            if fetched is None:
                await asyncio.sleep(pause)
                pause = min(pause * 2, max(RETRY_MAX, self._min_interval))
                if not self._used and not self._fresh():
                    return  # nobody asked meanwhile: the next get() starts over
                self._used = False
                continue
            pause = self._min_interval
            if fetched.lifetime is None:
                return  # never expires: nothing to refresh until `invalidate`
            await asyncio.sleep(self._next_refresh(fetched.lifetime))
            if not self._used:
                return  # nobody read it since: stop, the next get() starts over

    async def _fetch_once(self) -> Fetched[T] | None:
        """One fetch in a worker thread; its result (None: it failed) is stored and the
        waiters are woken."""
        self._settled.clear()
        self._fetching = True
        try:
            fetched = await asyncio.to_thread(self._fetch)
        except Exception as exc:  # noqa: BLE001 - any failure of the SDK's fetch
            self._error = f"could not get credentials ({type(exc).__name__})"
            return None
        else:
            self.fetches += 1
            self._store(fetched)
            self._used = False
            return fetched
        finally:
            self._fetching = False
            self._settled.set()

    def _store(self, fetched: Fetched[T]) -> None:
        self._value = fetched.value
        self._error = None
        if fetched.lifetime is None:
            self._good_until = self._refresh_at = None
        else:
            now = self._clock()
            self._good_until = now + fetched.lifetime - min(SAFETY, fetched.lifetime / 10)
            self._refresh_at = now + self._next_refresh(fetched.lifetime)

    def _next_refresh(self, lifetime: float) -> float:
        return max(self._min_interval, lifetime - min(REFRESH_AHEAD, lifetime / 2))

    def invalidate(self, refused: T | None = None) -> bool:
        """The upstream refused the value (a token revoked or expired before the time it
        said): hand it out no more; the next `get()` waits for a fresh one. With `refused`
        (the value a request was refused with), only when that is still the current value:
        requests refused together make one fetch, not one each. True when it invalidated."""
        if self._value is None or (refused is not None and refused is not self._value):
            return False
        self._good_until = self._clock()
        return True

    async def aclose(self) -> None:
        """Stop refreshing. A fetch running in its thread finishes there, unobserved."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
