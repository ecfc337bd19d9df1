"""The end of a logical request.

One owner ends every request, whatever path it takes: `RequestEnd`. It runs exactly once:
it releases the admission slot, closes the winner, reaps the losers, records the stats and
writes the one log line. The client is answered first: the proxy (`gateway.api.proxy`)
returns the request's answer as a value, an `Answer` (`gateway.api.answer`) holding the
response (a JSON body or an error) and this end, which it runs after the response is sent,
in the same request task, bounded by the race's reap timeout; a stream's response runs it
itself as soon as the relay is over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

import anyio

from gateway.clock import Clock
from gateway.hedge.continuation import Continuations
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.prefix import Prefix
from gateway.hedge.race import Race
from gateway.stats import RequestSummary, Stats
from gateway.stats.requestlog import log_request
from gateway.stats.spend import summary_cost
from gateway.wire.base import RelayOutcome, StreamEnd

if TYPE_CHECKING:
    from gateway.stats.tracing import RequestTrace

#: exceptions of ours on the request path, with their tracebacks
LOGGER = logging.getLogger("hedge_gateway.errors")
#: the key in a request's scope state that says its log line is (or will be) written by the
#: proxy and this end; without it the app writes a refusal's line
#: (`gateway.api.refusals`), so that every request has exactly one
LINE_KEY = "hedge_line"
#: the key in a request's scope state under which the proxy leaves the request's summary, for
#: what runs after its answer (a client key's limits charge its usage: `gateway.api.tenancy`)
SUMMARY_KEY = "hedge_summary"


def report_bug(stats: Stats, exc: BaseException) -> None:
    """An exception of ours on the request path: logged with its traceback and counted
    (`Stats.internal_errors`), once, by whoever turns it into the client's answer."""
    stats.internal_errors += 1
    LOGGER.error("internal error on the request path", exc_info=exc)


@dataclass(slots=True, eq=False)
class RequestEnd:
    """The one owner of the end of a logical request: callable any number of times, does its
    work once (see the module docstring for who calls it on which path).

    Plain data until it runs: the proxy builds it as the request is admitted (every path
    after that must give back what the request holds) and fills in what the race leaves,
    without a call into this file; the stream's close (or the answer, or the proxy) runs it,
    the one time the request steps in here."""

    pool: PoolRuntime
    race: Race
    summary: RequestSummary
    _: KW_ONLY
    #: gives the request's admission slot back
    leave: Callable[[], None]
    stats: Stats
    clock: Clock
    #: the request's spans when tracing is on, ended after the log line
    trace: RequestTrace | None = None
    #: the winner's upstream, once there is one: closed by the end
    prefix: Prefix | None = None
    #: the task watching the client for a disconnect, from the race to the last byte
    watcher: asyncio.Future[None] | None = None
    #: the request's continuations after commit, when it may have some: their races are
    #: closed by the end, their counts go to the summary
    continuations: Continuations | None = None
    done: bool = False

    async def after_stream(self, outcome: RelayOutcome, early_end: StreamEnd | None) -> None:
        """The end of a streamed answer, run by its stream as it closes (`on_close`, once):
        how the stream ended (`early_end`, when it ended before the relay did, else the
        relay's `outcome`) goes to the summary, then the request ends. (What the relay
        counted is in the summary already: the stream's `on_exhausted` took it, before this.)
        Here rather than a closure of the proxy's, so the stream's close steps into this
        file, not back into the proxy."""
        self.summary.relay_end = early_end or outcome.end
        await self()

    async def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        pool, summary, stats = self.pool, self.summary, self.stats
        if self.watcher is not None:
            self.watcher.cancel()
        with anyio.CancelScope(shield=True):
            # first, before any await: the answer is out, the request no longer counts (so a
            # client's next request on the same connection never meets its predecessor's slot)
            pool.inflight_requests -= 1
            self.leave()
            # and its winner's backend slot, for the same reason (a stream took it over and
            # gave it back already, as its last byte went out): the balancer's own call, left
            # by the race, called here (the leftovers' file is stepped into once, to reap)
            leftovers = self.race.leftovers
            release, leftovers.release = leftovers.release, None
            if release is not None:
                release()
            # each step on its own: a failing one must not keep the next from giving back
            # what it holds (the winner's and the losers' upstreams, their backend slots)
            try:
                # the relay that read the winner's upstream closed it (a stream that ended
                # early may not have): read the flag here, not a second call into its close
                prefix = self.prefix
                if prefix is not None and not prefix.closed:
                    await prefix.aclose()
            except Exception as exc:  # noqa: BLE001 - the end must go on; reported
                report_bug(stats, exc)
            try:
                await leftovers.aclose()
            except Exception as exc:  # noqa: BLE001 - the end must go on; reported
                report_bug(stats, exc)
            if self.continuations is not None:
                try:
                    await self.continuations.aclose()
                    summary.continuations = self.continuations.counts
                except Exception as exc:  # noqa: BLE001 - the end must go on; reported
                    report_bug(stats, exc)
            try:
                # (a race that never ran has made no choice: `Race.placement`)
                placement = getattr(self.race, "placement", None)
                if placement is not None:
                    summary.panic = placement.panic
                    summary.affinity = placement.affinity
                    summary.headroom_skips = placement.headroom_skips
                summary.ended = self.clock()
                summary.cost = summary_cost(summary, pool.prices)
                stats.record(summary)
                log_request(summary, stats.error_classes)
                if self.trace is not None:
                    self.trace.end(summary, stats.error_classes)
            except Exception as exc:  # noqa: BLE001 - the end must go on; reported
                report_bug(stats, exc)
            finally:
                # last: every upstream given back and the request accounted for, so this
                # runtime's providers may now be closed if a reload retired them, and a
                # reader of `holding` knows the request has wholly ended
                pool.holding -= 1
