"""Frozen settings: the whole configuration as plain data.

Validated once at load (see `gateway.settings.load`), then passed to whoever needs it. Durations
are seconds as floats. Defaults are the ones SPEC §5-§8 names. Provider keys are kept out of
every `repr` so a settings object can be logged without leaking them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class DelaySettings:
    """How long the race waits for a first token before it starts a hedge (SPEC §5.2)."""

    mode: Literal["adaptive", "fixed"] = "adaptive"
    #: a number in (0, 1) pins the quantile; "auto" derives it from the budget (SPEC §20)
    quantile: float | Literal["auto"] = "auto"
    min: float = 0.050
    max: float = 5.0
    initial: float = 0.5
    window: float = 60.0
    min_samples: int = 20
    #: the delay in `fixed` mode
    value: float = 0.3


@dataclass(frozen=True, slots=True)
class BudgetSettings:
    """The token bucket that caps extra attempts (SPEC §6)."""

    ratio: float = 0.1
    burst: float = 10.0
    min_per_second: float = 0.5
    min_win_rate: float = 0.15
    #: how many recent hedge outcomes the efficacy guard looks at (at least 20)
    win_window: int = 20
    #: in the ineffective state, at most one hedge per this many seconds
    probe_interval: float = 5.0


@dataclass(frozen=True, slots=True)
class HedgingSettings:
    enabled: bool = True
    max_attempts: int = 2
    delay: DelaySettings = field(default_factory=DelaySettings)
    budget: BudgetSettings = field(default_factory=BudgetSettings)


@dataclass(frozen=True, slots=True)
class Timeouts:
    """SPEC §8 limits, per pool."""

    connect: float = 2.0
    first_token: float = 30.0
    idle: float = 60.0
    max_stream: float = 600.0
    stuck_client: float = 30.0


@dataclass(frozen=True, slots=True)
class HealthSettings:
    """Ejection after consecutive failures, with a growing cool-down (SPEC §7)."""

    eject_after: int = 5
    cooldown: float = 5.0
    max_cooldown: float = 60.0
    #: the longest a Retry-After may keep a backend out of selection (SPEC §19)
    max_pause: float = 30.0
    #: below this share of usable backends (by weight), selection ignores pauses and
    #: ejections for the request (panic routing, SPEC §19)
    panic_below: float = 0.5


@dataclass(frozen=True, slots=True)
class SimProfile:
    """What a simulated backend does (SPEC §13). Times in seconds."""

    ttft_median: float = 0.15
    ttft_sigma: float = 0.25
    straggler_probability: float = 0.03
    straggler_extra: float = 1.5
    tokens: int = 30
    inter_token: float = 0.005
    usage: bool = True
    #: probability that a request fails with `fail_status` before any byte
    fail_probability: float = 0.0
    fail_status: int = 500
    #: probability that a request hangs (headers and role chunk, then nothing)
    hang_probability: float = 0.0
    #: probability that the stream errors in-band after a few tokens
    midstream_error_probability: float = 0.0
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class BackendSettings:
    name: str
    provider: Literal["openai", "sim"]
    model: str
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    group: str = ""
    weight: float = 1.0
    max_concurrency: int | None = None
    sim: SimProfile | None = None


@dataclass(frozen=True, slots=True)
class PoolSettings:
    name: str
    backends: tuple[BackendSettings, ...]
    #: the request deadline (SPEC §5.6)
    timeout: float = 60.0
    timeouts: Timeouts = field(default_factory=Timeouts)
    hedging: HedgingSettings = field(default_factory=HedgingSettings)
    health: HealthSettings = field(default_factory=HealthSettings)


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_body_bytes: int = 4 * MiB
    max_header_bytes: int = 16 * 1024
    max_concurrent_requests: int = 512
    #: keep-alive comment interval on client streams
    keepalive: float = 15.0
    #: on SIGTERM, how long live streams may run before they get a final error event
    shutdown_grace: float = 10.0
    #: a request whose head and body have not fully arrived by then gets 408 (SPEC §18)
    body_timeout: float = 30.0
    #: open client connections; past it a new connection gets 503 and is closed (SPEC §18)
    max_connections: int = 4096


@dataclass(frozen=True, slots=True)
class Settings:
    pools: tuple[PoolSettings, ...]
    server: ServerSettings = field(default_factory=ServerSettings)
    #: the global hedging switch; a pool hedges only when both are on
    hedging_enabled: bool = True

    def pool(self, name: str) -> PoolSettings | None:
        for pool in self.pools:
            if pool.name == name:
                return pool
        return None
