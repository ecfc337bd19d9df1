"""Small constructors for test settings: a pool of OpenAI-compatible loopback backends."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from gateway.settings import (
    BackendSettings,
    BudgetSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    ServerSettings,
    Settings,
    Timeouts,
)
from tests.harness import RecordedRequest, Script

POOL = "pool"


class InOrder:
    """A responder shared by several upstreams: the n-th request to arrive anywhere gets the
    n-th script (the last one repeats). Which backend the balancer picks first is random, so
    tests script by arrival order: "the first request to arrive anywhere is the primary"."""

    def __init__(self, *scripts: Script | Callable[[RecordedRequest], Script]) -> None:
        self.scripts = scripts
        self.arrivals: list[RecordedRequest] = []
        self._lock = threading.Lock()

    def __call__(self, request: RecordedRequest) -> Script:
        with self._lock:
            self.arrivals.append(request)
            n = len(self.arrivals) - 1
        chosen = self.scripts[min(n, len(self.scripts) - 1)]
        return chosen(request) if callable(chosen) else chosen


def backends_for(
    base_urls: Sequence[str], *, api_key: str | None = None, groups: Sequence[str] | None = None
) -> tuple[BackendSettings, ...]:
    return tuple(
        BackendSettings(
            name=f"b{i}",
            provider="openai",
            model=f"model-{i}",
            base_url=url,
            api_key=api_key,
            group=groups[i] if groups else f"zone-{i}",
        )
        for i, url in enumerate(base_urls)
    )


def gateway_settings(
    base_urls: Sequence[str],
    *,
    delay: float | None = 0.3,
    max_attempts: int = 2,
    hedging: bool = True,
    budget: BudgetSettings | None = None,
    timeout: float = 10.0,
    api_key: str | None = None,
    groups: Sequence[str] | None = None,
    timeouts: Timeouts | None = None,
    server: ServerSettings | None = None,
) -> Settings:
    """One pool named `pool`; `delay=None` means the adaptive default delay."""
    delay_settings = (
        DelaySettings() if delay is None else DelaySettings(mode="fixed", value=delay)
    )
    pool = PoolSettings(
        name=POOL,
        backends=backends_for(base_urls, api_key=api_key, groups=groups),
        timeout=timeout,
        timeouts=timeouts or Timeouts(),
        hedging=HedgingSettings(
            enabled=hedging,
            max_attempts=max_attempts,
            delay=delay_settings,
            budget=budget or BudgetSettings(),
        ),
    )
    return Settings(pools=(pool,), server=server or ServerSettings())
