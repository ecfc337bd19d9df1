"""The bench's workloads: what the simulators do and how much load
each workload sends. Data only; `gateway.bench.run` runs them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gateway.settings import SimProfile


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    description: str
    profile: SimProfile
    requests: int
    concurrency: int
    #: requests per mode with --quick
    quick_requests: int
    #: seconds added to every backend's TTFT for the middle of the run; 0 means no outage
    outage_extra: float = 0.0
    #: the outage covers these fractions of the request indexes
    outage_span: tuple[float, float] = (1 / 3, 2 / 3)
    #: simulated backends behind the gateway (the oracle races all of them)
    backends: int = 2
    #: the modes this workload runs (None: the plan's)
    modes: tuple[str, ...] | None = None
    #: the modes it runs with --quick (None: as `modes`)
    quick_modes: tuple[str, ...] | None = None
    #: requests of a pass at concurrency 1 before the main pass (0: none), and with --quick
    c1_requests: int = 0
    quick_c1_requests: int = 0
    #: the gateway's `server.max_concurrent_requests` (None: its default)
    max_concurrent_requests: int | None = None
    #: the gateway's `delay.window` in seconds (None: the default 60 s)
    delay_window: float | None = None
    #: report the best single-hedge policy at the budget, from the seeded draws
    single_hedge: bool = False
    #: run by `--quick` when no workload is named (`quick_set`)
    in_quick: bool = True
    #: the gateway's `hedging.stall.min` in seconds in the continuation modes (None: the
    #: default 2 s); see the `stalls` workload
    stall_min: float | None = None


_STRAGGLERS = SimProfile(ttft_median=0.15, ttft_sigma=0.25, straggler_probability=0.03,
                         straggler_extra=1.5, tokens=30, inter_token=0.005)

#: the slow shares of the straggler workloads
SLOW_SHARES = (3, 6, 10)
#: their delay window: 4,000 requests at 30 to 100 a second span 2 to 7 windows of 20 s, so
#: the delay settles and the run measures the settled rule, not the first minute
SHARE_DELAY_WINDOW = 20.0


def _share_workload(percent: int) -> Workload:
    return Workload(
        f"stragglers-{percent}", f"as stragglers, with {percent} % stragglers +1500 ms; "
        f"delay.window {SHARE_DELAY_WINDOW:g} s",
        dataclasses.replace(_STRAGGLERS, straggler_probability=percent / 100),
        requests=4000, concurrency=20, quick_requests=300,
        modes=("hedging-off", "hedging-on"), delay_window=SHARE_DELAY_WINDOW, single_hedge=True,
        in_quick=False)


#: `overhead` and `streams` simulators send usage only when asked (`stream_options`), as OpenAI
#: does: the gateway asks for it and strips it again, so a client that did not ask
#: gets the same events through the gateway as direct ("every token delivered" compares like
#: with like)
WORKLOADS: tuple[Workload, ...] = (
    Workload("stragglers", "lognormal TTFT (median 150 ms, sigma 0.25), 3 % stragglers +1500 ms,"
             " 30 tokens at 5 ms", _STRAGGLERS, requests=600, concurrency=20, quick_requests=100),
    Workload("outage", "as stragglers, but both backends +1500 ms for the middle third",
             _STRAGGLERS, requests=600, concurrency=20, quick_requests=60, outage_extra=1.5,
             # its target is the budget's bound on hedging-on; hedging-off beside it shows
             # the outage; direct and the oracle were 6 s of a quick run's context
             quick_modes=("hedging-off", "hedging-on")),
    Workload("overhead", "zero-latency backends (TTFT 0, inter-token 0), 50 tokens; first "
             "a pass at c=1 for the added TTFT",
             SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0,
                        straggler_extra=0.0, tokens=50, inter_token=0.0, usage=False),
             requests=2000, concurrency=50, quick_requests=300,
             modes=("direct", "hedging-off", "hedging-on"), c1_requests=300,
             quick_c1_requests=100),
    Workload("streams", "1,000 concurrent streams: TTFT 50 ms, 20 tokens 200 ms apart",
             SimProfile(ttft_median=0.05, ttft_sigma=0.0, straggler_probability=0.0,
                        straggler_extra=0.0, tokens=20, inter_token=0.2, usage=False),
             requests=1000, concurrency=1000, quick_requests=1000,
             modes=("direct", "hedging-on"), max_concurrent_requests=2048),
    Workload("pushback", "3 backends, TTFT median 150 ms (no stragglers), each answering 3 % "
             "with 503 + Retry-After: 1", SimProfile(
                 ttft_median=0.15, ttft_sigma=0.25, straggler_probability=0.0,
                 straggler_extra=0.0, tokens=30, inter_token=0.005, fail_probability=0.03,
                 fail_status=503),
             requests=600, concurrency=16, quick_requests=150, backends=3,
             # its targets are hedging off's and on's shares served; direct (no failover) and
             # the oracle racing all three backends were 7 s of a quick run's context
             quick_modes=("hedging-off", "hedging-on")),
    *(_share_workload(percent) for percent in SLOW_SHARES),
    Workload("stalls", "streams of 200 tokens 20 ms apart; 3 % stall 5 s at a random token, "
             "1 % break (reset) at a random token; continuations off and on side by side, and on "
             "without stalls or breaks (no-faults: the yardstick)",
             SimProfile(ttft_median=0.15, ttft_sigma=0.25, straggler_probability=0.0,
                        straggler_extra=0.0, tokens=200, inter_token=0.02, usage=False,
                        stall_probability=0.03, stall_length=5.0, break_probability=0.01),
             requests=600, concurrency=20, quick_requests=150,
             modes=("direct", "no-faults", "continuation-off", "continuation-on"),
             in_quick=False,
             # the stall delay's floor for streams with a token every 20 ms. A stalled stream
             # ends at least the stall delay plus a continuation's first token later than it
             # would have, and 3 % of the streams stall: from about a hundred requests up the
             # total-time p99 is a stalled stream's. The goal (1.25 x a 4.2 s stream) leaves
             # 1.05 s for both, which the default floor (2 s, for streams whose gaps run to
             # seconds) alone exceeds; the learnt delay (2 x the 95th percentile of each
             # stream's longest gap, about 0.1 s here) sits under any such floor
             stall_min=0.5),
)
#: `--workload` names that stand for several workloads
WORKLOAD_GROUPS = {"slow-shares": tuple(f"stragglers-{p}" for p in SLOW_SHARES)}


def selected(name: str, *, quick: bool) -> tuple[Workload, ...]:
    """The workloads `--workload name` runs. `all` with `--quick` leaves out the slow shares:
    what they show is the delay settling over several 20 s windows, and every target of
    theirs is a p99 or a share near its bound, which a quick run's 300 requests cannot
    decide (`gateway.bench.judge`); they were 40 % of the quick run's time. Named, they run
    in any size."""
    if name == "all":
        return tuple(w for w in WORKLOADS if w.in_quick or not quick)
    wanted = WORKLOAD_GROUPS.get(name, (name,))
    return tuple(w for w in WORKLOADS if w.name in wanted)
