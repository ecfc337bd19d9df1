"""Quota headroom: what a backend's rate-limit headers do to its selection, in virtual time
(a plain-number clock; the wall clock for RFC 3339 resets is a parameter too).

- `Headroom`: share = remaining / last seen limit; low until the reset, or until a later
  answer shows room; bounded by `default_pause` (no reset given) and `max_pause`;
- `Balancer`: a low backend is skipped for every choice while another candidate has room, and
  each skip is reported; all low: chosen as if none were; the state says `low`;
- the race: the skips are kept per request, a conversation's first backend being low is a
  spill, and a throttle that names no pause is paused for `health.default_pause`;
- the attempt hands a refusal's headers to the watcher as it does a success's.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from types import MappingProxyType

import pytest
import yaml

from gateway.errors import (
    UpstreamError,
    UpstreamPushback,
    UpstreamRateLimited,
    UpstreamStatusError,
    UpstreamUnavailable,
)
from gateway.hedge.affinity import AffinityRoute
from gateway.hedge.attempt import AttemptRecord, open_until_first_token
from gateway.hedge.balancer import Balancer
from gateway.hedge.headroom import Headroom
from gateway.hedge.placement import RaceOptions
from gateway.hedge.pool import PoolRuntime
from gateway.hedge.prefix import Prefix
from gateway.hedge.race import Race
from gateway.settings import BackendSettings, HealthSettings
from gateway.wire.chat import CHAT
from gateway.wire.ratelimit import Quota
from gateway.wire.sse import SSEBatch, SSEEvent
from providers.base import UpstreamCall
from tests.harness.builders import gateway_settings

HEALTH = HealthSettings(min_headroom=0.05, default_pause=2.0, max_pause=30.0)
WALL = 1735689600.0  # 2025-01-01T00:00:00Z
TOKEN = SSEEvent(b'{"choices":[{"index":0,"delta":{"content":"x"}}]}')


def left(remaining: int, limit: int | None = 100, reset: str | None = "10s") -> dict[str, str]:
    """OpenAI-style headers: `remaining` requests out of `limit`, resetting in `reset`."""
    headers = {"x-ratelimit-remaining-requests": str(remaining)}
    if limit is not None:
        headers["x-ratelimit-limit-requests"] = str(limit)
    if reset is not None:
        headers["x-ratelimit-reset-requests"] = reset
    return headers


def quota(remaining: float | None, limit: float | None = 100.0, reset: float | None = 10.0,
          resource: str = "requests") -> Quota:
    return Quota("openai", resource, remaining, limit, reset)


def unknown(name: str) -> float | None:
    return None


def balancer(*names: str, health: HealthSettings = HEALTH, groups: Mapping[str, str] = {},
             ) -> Balancer:
    backends = [BackendSettings(name=n, provider="sim", model="m", group=groups.get(n, ""))
                for n in names]
    return Balancer(backends, health, random.Random(7))


# --- Headroom --------------------------------------------------------------------------------


def observe(room: Headroom, *quotas: Quota, now: float = 0.0) -> None:
    room.observe(quotas, now, unknown_reset=2.0, longest=30.0)


def test_headroom_is_remaining_over_the_limit_of_the_same_answer() -> None:
    room = Headroom()
    observe(room, quota(4.0))
    reading = room.lowest(0.0)
    assert reading is not None and reading.share == pytest.approx(0.04)
    assert room.low_until(0.0, 0.05) == 10.0
    assert room.low_until(0.0, 0.04) is None  # under the floor, strictly


def test_an_answer_without_a_limit_uses_the_last_one_seen() -> None:
    room = Headroom()
    observe(room, quota(None, limit=1000.0))  # the limit alone: no share yet
    assert room.lowest(0.0) is None
    observe(room, quota(30.0, limit=None), now=1.0)
    reading = room.lowest(1.0)
    assert reading is not None and reading.share == pytest.approx(0.03)


def test_no_limit_ever_seen_means_no_share_and_never_low() -> None:
    room = Headroom()
    observe(room, quota(0.0, limit=None))
    assert room.lowest(0.0) is None and room.low_until(0.0, 0.05) is None


def test_low_until_the_reset_then_as_if_never_seen() -> None:
    room = Headroom()
    observe(room, quota(1.0, reset=8.0), now=100.0)
    assert room.low_until(107.9, 0.05) == 108.0
    assert room.low_until(108.0, 0.05) is None
    assert room.lowest(108.0) is None  # past its reset the reading says nothing


def test_a_later_answer_with_room_ends_low_at_once() -> None:
    room = Headroom()
    observe(room, quota(1.0, reset=60.0))
    observe(room, quota(50.0), now=1.0)
    assert room.low_until(1.0, 0.05) is None


def test_an_answer_without_rate_limit_headers_changes_nothing() -> None:
    room = Headroom()
    observe(room, quota(1.0, reset=20.0))
    observe(room, now=1.0)
    assert room.low_until(1.0, 0.05) == 20.0


def test_the_low_mark_is_bounded_by_default_and_max_pause() -> None:
    room = Headroom()
    observe(room, quota(0.0, reset=None))
    assert room.low_until(0.0, 0.05) == 2.0  # no reset given: unknown_reset
    observe(room, quota(0.0, reset=86400.0))
    assert room.low_until(0.0, 0.05) == 30.0  # a daily quota: no more than longest


def test_the_latest_reset_of_the_low_resources_ends_low() -> None:
    room = Headroom()
    observe(room, quota(1.0, reset=5.0), quota(2.0, reset=20.0, resource="tokens"),
            quota(90.0, reset=1.0, resource="input-tokens"))
    assert room.low_until(0.0, 0.05) == 20.0
    reading = room.lowest(0.0)
    assert reading is not None and reading.resource == "requests"
    assert room.low_until(6.0, 0.05) == 20.0  # tokens still low after requests reset
    reading = room.lowest(6.0)
    assert reading is not None and reading.resource == "tokens"


def test_min_headroom_zero_never_marks_low() -> None:
    room = Headroom()
    observe(room, quota(0.0))
    assert room.low_until(0.0, 0.0) is None


# --- Balancer ------------------------------------------------------------------------------


def test_a_low_backend_is_skipped_while_another_has_room() -> None:
    bal = balancer("a", "b", "c")
    bal.observe_quota("a", left(2), 0.0, WALL)
    skipped: list[str] = []
    picks = Counter(bal.pick(1.0, ttft=unknown, skipped=skipped) for _ in range(200))
    assert set(picks) == {"b", "c"}
    assert skipped == ["a"] * 200  # once per choice it was left out of
    assert bal.state("a", 1.0) == ("low", "2.0% of its requests quota left")
    assert bal.seconds_left("a", 1.0) == pytest.approx(9.0)
    headroom = bal.headroom("a", 1.0)
    assert headroom is not None and headroom[0] == pytest.approx(0.02)
    assert bal.state("b", 1.0) == ("ok", None) and bal.headroom("b", 1.0) is None


def test_when_every_candidate_is_low_the_choice_is_as_today() -> None:
    bal = balancer("a", "b")
    for name in ("a", "b"):
        bal.observe_quota(name, left(1), 0.0, WALL)
    skipped: list[str] = []
    picks = Counter(bal.pick(1.0, ttft=unknown, skipped=skipped) for _ in range(200))
    assert set(picks) == {"a", "b"} and skipped == []
    assert bal.usable(1.0) == ["a", "b"]  # never refused, never paused
    assert not bal.panic(1.0)


def test_the_other_backends_having_room_is_per_choice() -> None:
    """A backend excluded from this choice (already running an attempt) does not count as
    room: the low one is then the only candidate and is chosen."""
    bal = balancer("a", "b")
    bal.observe_quota("a", left(1), 0.0, WALL)
    skipped: list[str] = []
    assert bal.pick(1.0, exclude={"b"}, ttft=unknown, skipped=skipped) == "a"
    assert skipped == []


def test_the_reset_restores_a_low_backend() -> None:
    bal = balancer("a", "b")
    bal.observe_quota("a", left(0, reset="5s"), 100.0, WALL)
    assert {bal.pick(104.9, ttft=unknown) for _ in range(50)} == {"b"}
    assert {bal.pick(105.0, ttft=unknown) for _ in range(100)} == {"a", "b"}
    assert bal.state("a", 105.0) == ("ok", None) and bal.seconds_left("a", 105.0) is None


def test_a_later_answer_with_room_restores_it_before_the_reset() -> None:
    bal = balancer("a", "b")
    bal.observe_quota("a", left(0, reset="60s"), 0.0, WALL)
    bal.observe_quota("a", left(80), 1.0, WALL)
    assert {bal.pick(1.0, ttft=unknown) for _ in range(100)} == {"a", "b"}


def test_an_anthropic_reset_is_read_against_the_wall_clock() -> None:
    bal = balancer("a", "b")
    bal.observe_quota("a", {"anthropic-ratelimit-tokens-limit": "10000",
                            "anthropic-ratelimit-tokens-remaining": "100",
                            "anthropic-ratelimit-tokens-reset": "2025-01-01T00:00:12Z"},
                      50.0, WALL + 2.0)
    assert bal.seconds_left("a", 50.0) == pytest.approx(10.0)
    assert bal.state("a", 50.0)[0] == "low"


def test_a_pause_or_an_ejection_shows_before_low() -> None:
    bal = balancer("a", "b")
    bal.observe_quota("a", left(0, reset="20s"), 0.0, WALL)
    bal.pause("a", 5.0, 0.0)
    assert bal.state("a", 1.0) == ("paused", "retry-after")
    assert bal.seconds_left("a", 1.0) == pytest.approx(4.0)
    assert bal.state("a", 6.0)[0] == "low"
    assert bal.seconds_left("a", 6.0) == pytest.approx(14.0)


def test_garbage_headers_change_nothing() -> None:
    bal = balancer("a", "b")
    bal.observe_quota("a", {"x-ratelimit-remaining-requests": "none",
                            "x-ratelimit-limit-requests": "-5", "x-ratelimit-reset-requests": "x"},
                      0.0, WALL)
    assert bal.state("a", 0.0) == ("ok", None) and bal.headroom("a", 0.0) is None


def test_a_backend_a_reload_removed_is_ignored_and_a_kept_one_keeps_its_headroom() -> None:
    bal = balancer("a", "b")
    bal.observe_quota("gone", left(0), 0.0, WALL)
    bal.observe_quota("a", left(0), 0.0, WALL)
    backends = [BackendSettings(name=n, provider="sim", model="m") for n in ("a", "c")]
    reloaded = bal.adopt(backends, HEALTH)
    assert reloaded.state("a", 1.0)[0] == "low"
    assert reloaded.pick(1.0, ttft=unknown) == "c"


def test_room_comes_before_another_group_for_a_hedge() -> None:
    bal = balancer("a", "b", "c", groups={"a": "z1", "b": "z1", "c": "z2"})
    bal.observe_quota("c", left(1), 0.0, WALL)
    skipped: list[str] = []
    assert bal.pick(1.0, exclude={"a"}, avoid_groups={"z1"}, ttft=unknown,
                    skipped=skipped) == "b"
    assert skipped == ["c"]


def test_panic_routing_prefers_room_too() -> None:
    bal = balancer("a", "b")
    for name in ("a", "b"):
        bal.pause(name, 10.0, 0.0)
    bal.observe_quota("a", left(1, reset="60s"), 0.0, WALL)
    bal.pause("b", 20.0, 0.0)  # b's pause ends later: panic alone would choose a
    skipped: list[str] = []
    assert bal.pick(1.0, ttft=unknown, skipped=skipped) == "b"
    assert skipped == ["a"]


def test_prefer_room() -> None:
    bal = balancer("a", "b", "c")
    bal.observe_quota("b", left(0), 0.0, WALL)
    assert bal.prefer_room(["a", "b", "c"], 1.0) == (["a", "c"], ["b"])
    assert bal.prefer_room(["b"], 1.0) == (["b"], [])
    assert bal.prefer_room([], 1.0) == ([], [])


# --- the race --------------------------------------------------------------------------------


class Clock:
    """Virtual monotonic time, moved by the test."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def _no_batches() -> AsyncIterator[SSEBatch]:
    if False:
        yield SSEBatch([])


class Done:
    headers: Mapping[str, str] = MappingProxyType({})

    def batches(self) -> AsyncIterator[SSEBatch]:
        return _no_batches()

    async def aclose(self) -> None:
        return None


def token() -> Prefix:
    return Prefix(Done(), _no_batches(), [TOKEN])


def pool_of(backends: int, clock: Clock, *, health: HealthSettings = HEALTH,
            max_attempts: int = 2) -> PoolRuntime:
    settings = gateway_settings(["http://127.0.0.1:9/v1"] * backends, delay=30.0,
                                max_attempts=max_attempts)
    pool = dataclasses.replace(settings.pools[0], health=health)
    return PoolRuntime.build(pool, {}, global_hedging=True, now=clock(), rng=random.Random(3))


async def run_race(pool: PoolRuntime, clock: Clock, route: AffinityRoute | None = None,
                   fail: UpstreamError | None = None) -> tuple[Race, list[str]]:
    seen: list[str] = []

    async def runner(backend: str, record: AttemptRecord) -> Prefix:
        seen.append(backend)
        if fail is not None:
            raise fail
        return token()

    race = Race(pool, runner, RaceOptions(clock() + 60.0, pool.delays, True, affinity=route),
                clock)
    try:
        await race.run()
    finally:
        await race.aclose()
    return race, seen


async def test_the_race_sends_no_primary_to_a_low_backend_and_keeps_its_skips() -> None:
    clock = Clock()
    pool = pool_of(3, clock)
    pool.balancer.observe_quota("b1", left(3), clock(), WALL)
    for _ in range(30):
        race, seen = await run_race(pool, clock)
        assert seen[0] != "b1" and race.placement.headroom_skips == ["b1"]
    clock.now += 10.0  # its reset
    primaries = set()
    for _ in range(60):
        race, seen = await run_race(pool, clock)
        primaries.add(seen[0])
        assert race.placement.headroom_skips == []
    assert "b1" in primaries


async def test_the_watch_an_attempt_gets_feeds_the_pools_balancer() -> None:
    clock = Clock()
    pool = pool_of(2, clock)
    pool.quota_watch("b0", clock)(left(0))
    assert pool.balancer.state("b0", clock())[0] == "low"


def route_of(pool: PoolRuntime, key: str) -> AffinityRoute:
    return AffinityRoute.of(key, {b.name: b.weight for b in pool.settings.backends}, 1.25)


async def test_a_low_first_backend_of_a_conversation_is_a_spill_and_a_skip() -> None:
    clock = Clock()
    pool = pool_of(3, clock)
    route = route_of(pool, "conversation-1")
    first, second = route.order[0], route.order[1]
    race, seen = await run_race(pool, clock, route)
    assert (seen, race.placement.affinity, race.placement.headroom_skips) == ([first], "hit", [])
    pool.balancer.observe_quota(first, left(1), clock(), WALL)
    race, seen = await run_race(pool, clock, route)
    placed = race.placement
    assert (seen, placed.affinity, placed.headroom_skips) == ([second], "spill", [first])
    clock.now += 10.0  # the reset: the conversation goes home
    race, seen = await run_race(pool, clock, route)
    assert (seen, race.placement.affinity, race.placement.headroom_skips) == ([first], "hit", [])


async def test_a_conversation_whose_every_backend_is_low_goes_home() -> None:
    clock = Clock()
    pool = pool_of(3, clock)
    route = route_of(pool, "conversation-2")
    for name in route.order:
        pool.balancer.observe_quota(name, left(1), clock(), WALL)
    race, seen = await run_race(pool, clock, route)
    placed = race.placement
    assert (seen, placed.affinity, placed.headroom_skips) == ([route.order[0]], "hit", [])


@pytest.mark.parametrize("default_pause", [0.5, 7.0])
async def test_a_429_without_retry_after_pauses_for_default_pause(default_pause: float) -> None:
    clock = Clock()
    pool = pool_of(1, clock, health=dataclasses.replace(HEALTH, default_pause=default_pause),
                   max_attempts=1)
    with pytest.raises(UpstreamPushback) as info:
        await run_race(pool, clock, fail=UpstreamStatusError.of(429))
    assert info.value.status == 429 and info.value.retry_after == default_pause
    assert pool.balancer.state("b0", clock()) == ("paused", "retry-after")
    assert pool.balancer.seconds_left("b0", clock()) == default_pause


async def test_a_throttle_keeps_its_own_retry_after_and_a_503_without_one_is_no_throttle() -> None:
    clock = Clock()
    pool = pool_of(1, clock, max_attempts=1)
    with pytest.raises(UpstreamPushback):
        await run_race(pool, clock, fail=UpstreamRateLimited(429, retry_after=9.0))
    assert pool.balancer.seconds_left("b0", clock()) == 9.0
    clock.now += 10.0
    with pytest.raises(Exception) as info:
        await run_race(pool, clock, fail=UpstreamUnavailable(503))
    assert info.value.__class__.__name__ == "AllAttemptsFailed"
    assert pool.balancer.state("b0", clock()) == ("ok", None)


# --- the attempt hands over what it saw ---------------------------------------------------------


class Refusing:
    name = "b0"
    serves = frozenset({"chat/completions"})

    def __init__(self, error: UpstreamError | None) -> None:
        self.error = error

    async def open(self, call: UpstreamCall) -> Done:
        if self.error is not None:
            raise self.error
        stream = Done()
        stream.headers = left(7)
        return stream

    async def aclose(self) -> None:
        return None


async def test_the_attempt_hands_a_refusals_headers_to_the_watch_as_a_successes() -> None:
    call = UpstreamCall("chat/completions", {}, True, "r", 1.0)
    seen: list[Mapping[str, str]] = []
    refusal = UpstreamStatusError.of(429)
    refusal.quota = left(0)
    with pytest.raises(UpstreamRateLimited):
        await open_until_first_token(Refusing(refusal), call, lambda: False, CHAT,
                                     seen=seen.append)
    assert seen == [left(0)]
    with pytest.raises(UpstreamError):  # opened, then no token: the headers were seen first
        await open_until_first_token(Refusing(None), call, lambda: False, CHAT,
                                     seen=seen.append)
    assert seen == [left(0), left(7)]


# --- the settings --------------------------------------------------------------------------------


def _health(text: str) -> HealthSettings:
    from gateway.settings.load import parse_settings

    data = {"pools": [{"name": "chat", "health": yaml.safe_load(text),
                       "backends": [{"name": "a", "base_url": "http://127.0.0.1:9/v1"}]}]}
    return parse_settings(data, {}).pools[0].health


def test_default_pause_and_min_headroom_defaults_and_values() -> None:
    assert (HealthSettings().default_pause, HealthSettings().min_headroom) == (1.0, 0.05)
    health = _health("{default_pause: 250ms, min_headroom: 0.2}")
    assert (health.default_pause, health.min_headroom) == (0.25, 0.2)
    assert _health("{min_headroom: 0}").min_headroom == 0.0


@pytest.mark.parametrize(("text", "complaint"), [
    ("{default_pause: 0s}", "default_pause: must be > 0"),
    ("{default_pause: -1}", "default_pause"),
    ("{default_pause: 31s}", "default_pause: must be <= max_pause"),
    ("{default_pause: 5s, max_pause: 2s}", "default_pause: must be <= max_pause"),
    ("{min_headroom: 1}", "min_headroom"),
    ("{min_headroom: -0.1}", "min_headroom"),
    ("{min_headroom: lots}", "min_headroom"),
])
def test_default_pause_and_min_headroom_are_validated(text: str, complaint: str) -> None:
    from gateway.settings.load import ConfigError

    with pytest.raises(ConfigError) as caught:
        _health(text)
    assert any(complaint in error for error in caught.value.errors), caught.value.errors
