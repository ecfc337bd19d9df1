"""The hedge budget: how many extra attempts a pool may start. Pure.

No I/O, no asyncio; time comes in as `now` (monotonic seconds) and the token level is computed
lazily from it, so no timer is needed.

Why a budget at all: hedging pays off when slowness is *independent* across backends (one host
has a hiccup, the copy on another host answers). When every backend is slow at once (a shared
dependency, an overloaded region, a huge prompt), every request passes its hedge delay, and
unbounded hedging would double the load exactly when the backends can least take it. So:

- tokens come from traffic: each logical request deposits `ratio` (0.1: at most one extra
  attempt per ten requests in steady state), capped at `burst`, and the bucket starts full so
  a short burst of trouble is covered;
- a small time-based reserve (`min_per_second`) lets a quiet pool hedge at all;
- each extra attempt (hedge or failure replacement) spends one token;
- at most max(3, 20 % of in-flight requests) extra attempts run at once, so a burst of tokens
  cannot become a burst of duplicates;
- the efficacy guard watches whether hedges actually win. When the last `win_window` hedge
  outcomes show, with 95 % confidence, a win rate below `min_win_rate` (the upper end of the
  Wilson score interval is below it), slowness is shared and hedges are wasted: only one probe
  hedge per `probe_interval` is let through (it still spends a token), and probes that win
  push the interval back up until the guard lets go. A test on the interval, not on the
  point estimate: a healthy pool whose hedges win a third of the time shows 2 wins in 20 by
  chance often enough (checked after every hedge) that a point-estimate guard switched
  hedging off for the rest of short runs. With the interval, 16 straight losses engage it
  (faster than the 20 the point estimate needed), and in a window of 20 only a window
  without a single win does, which a pool whose hedges win a third of the time shows about
  once in 3,000 windows. Failure replacements are not subject to the guard:
  a failed attempt needs a replacement whether or not delay-triggered hedges are winning.

Input tokens (`input_tokens`, on by default): an extra attempt resends the whole prompt, so a
hedge of a 30,000-token turn costs what 150 hedges of a 200-token one do, and counting
attempts alone lets a few long prompts spend many times the share of input the ratio means.
Beside the attempt bucket runs a second one in input tokens, with the same rules: each request
deposits `ratio` x its input tokens, each extra attempt needs (and spends) its input tokens,
capped at `burst_input_tokens`, starting full, with a reserve that refills the whole bucket in
the same time the attempt reserve refills its own (`min_per_second / burst` of it a second).
An extra attempt needs both. One larger than the whole bucket goes only from a full bucket and
is charged the whole bucket, no more: it empties the bucket and leaves no debt. Why not its
full size: a debt takes every later extra attempt of the pool with it until deposits repay it,
and one estimate can be far off (a base64 screenshot counts about 100 times its real tokens),
so one 3 MiB body's failover would refuse every small failover of the pool for minutes while
a healthy backend stands by. Emptying the bucket is enough to keep such attempts rare: each
one needs a full bucket again, and the attempt bucket still counts it as one of its `ratio`
extra attempts per request. Tokens here are the gateway's estimate (body bytes / 4), known
before any upstream answers.
"""

from __future__ import annotations

import enum
import math
from collections import deque

from gateway.settings import BudgetSettings

#: the in-flight cap on extra attempts is max(_MIN_EXTRA_IN_FLIGHT, _EXTRA_SHARE * requests)
_MIN_EXTRA_IN_FLIGHT = 3
_EXTRA_SHARE = 0.2
#: the normal quantile of the guard's one-sided 95 % confidence
_Z = 1.645
#: slack when comparing the float token level with 1: ten deposits of 0.1 sum to
#: 0.9999999999999999, and the tenth request must still earn its token
_EPSILON = 1e-9


class SuppressReason(enum.StrEnum):
    """Why a hedge or replacement did not start; the values are stats keys.

    A `StrEnum` (so a `str` and an `Enum`, as `(str, Enum)` would be), chosen because its
    `str()` and f-string form is the bare value ("budget"), which is what logs and JSON want.
    """

    MAX_ATTEMPTS = "max_attempts"
    NO_BACKEND = "no_backend"
    BUDGET = "budget"
    DEADLINE = "deadline"
    INEFFECTIVE = "ineffective"
    DISABLED = "disabled"
    #: the copy would prefill the whole input cold for longer than the primary likely needs
    COLD = "cold"
    #: a hedge a deadline would have sent early, refused by the key's own share of the budget
    KEY_BUDGET = "key_budget"


class HedgeBudget:
    """Token bucket, in-flight cap and efficacy guard for one pool's extra attempts."""

    __slots__ = (
        "_extra_in_flight",
        "_input",
        "_last_probe",
        "_outcomes",
        "_tokens",
        "_updated",
        "_wins",
        "hedges_recorded",
        "settings",
    )

    def __init__(self, settings: BudgetSettings, now: float) -> None:
        self.settings = settings
        self._tokens = settings.burst
        #: the input-token bucket's level: never below 0 (an attempt is charged at most the
        #: whole bucket)
        self._input = float(settings.burst_input_tokens)
        self._updated = now
        self._extra_in_flight = 0
        #: recent hedge outcomes (True = won), newest last
        self._outcomes: deque[bool] = deque(maxlen=max(1, settings.win_window))
        self._wins = 0
        #: when the last hedge was let through while the guard was on
        self._last_probe: float | None = None
        #: hedge outcomes recorded since start (readers tell a new win rate from an old one)
        self.hedges_recorded = 0

    def reconfigure(self, settings: BudgetSettings, now: float) -> None:
        """New settings from a reload. The bucket keeps its level (capped at the new `burst`),
        its extra attempts in flight and its recent hedge outcomes: a reload must not hand a
        pool a fresh burst of hedges, nor forget that hedging was not winning."""
        if settings == self.settings:
            return
        self._accrue(now)
        self.settings = settings
        self._tokens = min(self._tokens, settings.burst)
        self._input = min(self._input, float(settings.burst_input_tokens))
        size = max(1, settings.win_window)
        if self._outcomes.maxlen != size:
            self._outcomes = deque(self._outcomes, maxlen=size)
            self._wins = sum(self._outcomes)

    # -- tokens ---------------------------------------------------------------------------

    def _level(self, now: float) -> float:
        elapsed = now - self._updated
        if elapsed <= 0:
            return self._tokens
        return min(self.settings.burst, self._tokens + self.settings.min_per_second * elapsed)

    def _input_level(self, now: float) -> float:
        elapsed = now - self._updated
        cap = float(self.settings.burst_input_tokens)
        if elapsed <= 0:
            return self._input
        refill = cap * self.settings.min_per_second / self.settings.burst
        return min(cap, self._input + refill * elapsed)

    def _accrue(self, now: float) -> None:
        self._input = self._input_level(now)
        self._tokens = self._level(now)
        self._updated = max(self._updated, now)

    def tokens(self, now: float) -> float:
        """Tokens available at `now`, reserve accrual included."""
        return self._level(now)

    def input_tokens(self, now: float) -> float:
        """Input tokens available at `now` in the input-token bucket (never below 0)."""
        return self._input_level(now)

    def on_request(self, now: float, tokens: int = 0) -> None:
        """A logical request of `tokens` estimated input tokens arrived: deposit `ratio`
        tokens (capped at `burst`) and `ratio x tokens` input tokens (capped at
        `burst_input_tokens`)."""
        self._accrue(now)
        settings = self.settings
        self._tokens = min(settings.burst, self._tokens + settings.ratio)
        if settings.input_tokens and tokens > 0:
            self._input = min(float(settings.burst_input_tokens),
                              self._input + settings.ratio * tokens)

    # -- spending -------------------------------------------------------------------------

    @property
    def extra_in_flight(self) -> int:
        """Extra attempts granted and not yet released."""
        return self._extra_in_flight

    def try_spend(
        self, now: float, *, inflight_requests: int, hedge: bool, tokens: int = 0
    ) -> SuppressReason | None:
        """Ask for one extra attempt of `tokens` estimated input tokens; None means granted
        (one token and its input tokens spent, one more extra attempt in flight: call
        `release()` when it ends, whatever the outcome).

        `hedge=True` for a delay-triggered hedge, False for a replacement after a failure.
        Refusals: INEFFECTIVE (hedges only) when the efficacy guard is on and this probe
        interval's probe was already used; BUDGET when under one token, under its input
        tokens (or, for an attempt larger than the whole bucket, under a full bucket), or
        when the in-flight cap is reached. Nothing changes on a refusal. An attempt larger
        than the bucket is charged the whole bucket: the level never goes below 0 (the module
        docstring says why no debt).
        """
        guarded = hedge and self.ineffective(now)
        last_probe = self._last_probe
        if guarded and last_probe is not None and now - last_probe < self.settings.probe_interval:
            return SuppressReason.INEFFECTIVE
        self._accrue(now)
        if self._tokens < 1.0 - _EPSILON:
            return SuppressReason.BUDGET
        priced = self.settings.input_tokens and tokens > 0
        price = min(float(tokens), float(self.settings.burst_input_tokens))
        if priced and self._input < price - _EPSILON:
            return SuppressReason.BUDGET
        cap = max(_MIN_EXTRA_IN_FLIGHT, _EXTRA_SHARE * inflight_requests)
        if self._extra_in_flight >= cap:
            return SuppressReason.BUDGET
        self._tokens = max(0.0, self._tokens - 1.0)
        if priced:
            self._input = max(0.0, self._input - price)
        self._extra_in_flight += 1
        if guarded:
            self._last_probe = now
        return None

    def release(self) -> None:
        """An extra attempt granted by `try_spend` finished (any outcome)."""
        if self._extra_in_flight > 0:
            self._extra_in_flight -= 1

    # -- efficacy guard -------------------------------------------------------------------

    def record_hedge(self, won: bool, now: float) -> None:
        """The outcome of one hedge that started: `won` if it produced the winning stream.

        `now` is accepted for symmetry with the other methods; the window is by count.
        """
        outcomes = self._outcomes
        if len(outcomes) == outcomes.maxlen and outcomes[0]:
            self._wins -= 1
        outcomes.append(won)
        self.hedges_recorded += 1
        if won:
            self._wins += 1

    def win_rate(self) -> float | None:
        """Share of the recent hedge outcomes that won; None before any hedge finished."""
        if not self._outcomes:
            return None
        return self._wins / len(self._outcomes)

    def ineffective(self, now: float) -> bool:
        """True while the efficacy guard is on: the recent hedge outcomes' win rate is below
        `min_win_rate` with 95 % confidence (the module docstring says why a confidence
        bound). `now` is accepted for symmetry; the guard is by count."""
        n = len(self._outcomes)
        if n == 0:
            return False
        return wilson_upper(self._wins, n) < self.settings.min_win_rate


def wilson_upper(wins: int, n: int, z: float = _Z) -> float:
    """The upper end of the Wilson score interval for `wins` out of `n` (n > 0): the largest
    win rate the outcomes are still consistent with, at the confidence `z` stands for."""
    p = wins / n
    z2 = z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return (centre + spread) / (1 + z2 / n)
