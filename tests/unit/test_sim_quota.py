"""The simulator's request quota: what is left decreases per request, in the route's header
family, resets with its window, and past it a 429 with Retry-After; the gateway's parser
reads what the simulator writes. Plain-number clocks, apart from the in-process provider
(whose window is far longer than the test)."""

from __future__ import annotations

import pytest

from gateway.errors import UpstreamRateLimited
from gateway.settings import BackendSettings, SimProfile
from gateway.wire.ratelimit import read_quotas
from providers.base import UpstreamCall
from providers.sim import SimProvider
from providers.sim.quota import SimQuota

WALL = 1735689600.0


def test_remaining_decreases_per_request_then_the_quota_refuses() -> None:
    quota = SimQuota(limit=3, window=10.0)
    seen = []
    for t in (0.0, 1.0, 2.0):
        assert quota.take(t)
        seen.append(quota.headers("chat/completions", t)["x-ratelimit-remaining-requests"])
    assert seen == ["2", "1", "0"]
    assert not quota.take(3.0)
    assert quota.retry_after(3.0) == 7.0
    assert quota.headers("chat/completions", 3.0) == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "7.000s"}
    assert quota.take(10.0)  # the next window
    assert quota.headers("chat/completions", 10.0)["x-ratelimit-remaining-requests"] == "2"


def test_the_gateway_reads_both_families_the_simulator_writes() -> None:
    quota = SimQuota(limit=100, window=30.0)
    quota.take(0.0)
    (openai,) = read_quotas(quota.headers("responses", 5.0), wall=WALL)
    assert (openai.family, openai.remaining, openai.limit, openai.reset_in) == (
        "openai", 99.0, 100.0, 25.0)
    (anthropic,) = read_quotas(quota.headers("messages", 5.0, wall=WALL), wall=WALL)
    assert (anthropic.family, anthropic.remaining, anthropic.limit) == ("anthropic", 99.0, 100.0)
    assert anthropic.reset_in == pytest.approx(25.0, abs=0.001)


def test_a_quota_of_zero_is_no_quota() -> None:
    provider = SimProvider(BackendSettings("s", "sim", "m", sim=SimProfile(ttft_median=0.0)))
    assert provider.quota is None


async def test_the_in_process_provider_states_its_quota_and_refuses_past_it() -> None:
    profile = SimProfile(ttft_median=0.0, ttft_sigma=0.0, straggler_probability=0.0, tokens=2,
                         inter_token=0.0, rate_limit_requests=2, rate_limit_window=3600.0)
    provider = SimProvider(BackendSettings("s", "sim", "m", sim=profile))
    call = UpstreamCall("messages", {"model": "m", "max_tokens": 5,
                                     "messages": [{"role": "user", "content": "hi"}]}, True, "r",
                        5.0)
    left = []
    for _ in range(2):
        stream = await provider.open(call)
        left.append(stream.headers["anthropic-ratelimit-requests-remaining"])
        await stream.aclose()
    assert left == ["1", "0"]
    with pytest.raises(UpstreamRateLimited) as info:
        await provider.open(call)
    assert info.value.retry_after is not None and info.value.retry_after >= 1.0
    assert info.value.quota["anthropic-ratelimit-requests-remaining"] == "0"
