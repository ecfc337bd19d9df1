"""Backend selection and health, with a seeded rng and a plain-number clock."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.hedge.balancer import Balancer
from gateway.settings import BackendSettings, HealthSettings

HEALTH = HealthSettings(eject_after=3, cooldown=5.0, max_cooldown=20.0)


def backend(
    name: str, *, group: str = "", weight: float = 1.0, max_concurrency: int | None = None
) -> BackendSettings:
    return BackendSettings(
        name=name,
        provider="sim",
        model="m",
        group=group,
        weight=weight,
        max_concurrency=max_concurrency,
    )


def unknown(name: str) -> float | None:
    return None


def make(*backends: BackendSettings, seed: int = 1) -> Balancer:
    return Balancer(backends, HEALTH, random.Random(seed))


def test_duplicate_names_rejected() -> None:
    with pytest.raises(ValueError):
        make(backend("a"), backend("a"))


def test_single_and_no_backend() -> None:
    bal = make(backend("a"))
    assert bal.pick(0.0, ttft=unknown) == "a"
    assert bal.pick(0.0, exclude={"a"}, ttft=unknown) is None
    assert bal.names == ["a"]


def test_a_pair_draws_one_random_number_per_pick() -> None:
    """Of two candidates the first is drawn by weight and the second is the other: no second
    draw (it could only return the one left), which cost a `random.choices` per request."""
    rng = random.Random(7)
    bal = Balancer([backend("a"), backend("b", weight=3.0)], HEALTH, rng)
    twin = random.Random(7)
    for _ in range(20):
        bal.pick(0.0, ttft=unknown)
        twin.random()
        assert rng.getstate() == twin.getstate()


def test_prefers_less_loaded() -> None:
    bal = make(backend("a"), backend("b"))
    for _ in range(3):
        bal.on_start("a")
    picks = {bal.pick(0.0, ttft=unknown) for _ in range(50)}
    assert picks == {"b"}
    assert bal.inflight("a") == 3


def test_prefers_faster() -> None:
    bal = make(backend("a"), backend("b"))
    ttfts = {"a": 0.4, "b": 0.1}
    picks = {bal.pick(0.0, ttft=ttfts.get) for _ in range(50)}
    assert picks == {"b"}


def test_load_times_ttft() -> None:
    bal = make(backend("a"), backend("b"))
    ttfts = {"a": 0.4, "b": 0.1}
    # b is 4x faster but has 4 attempts in flight: (4+1)*0.1 = 0.5 > (0+1)*0.4
    for _ in range(4):
        bal.on_start("b")
    assert {bal.pick(0.0, ttft=ttfts.get) for _ in range(50)} == {"a"}
    bal.on_finish("b")  # (3+1)*0.1 = 0.4: a tie, decided by the sampling order
    assert {bal.pick(0.0, ttft=ttfts.get) for _ in range(200)} == {"a", "b"}
    bal.on_finish("b")  # (2+1)*0.1 = 0.3 < 0.4
    assert {bal.pick(0.0, ttft=ttfts.get) for _ in range(50)} == {"b"}


def test_unknown_ttft_is_explored() -> None:
    bal = make(backend("known"), backend("new"))
    ttfts: dict[str, float | None] = {"known": 0.1, "new": None}
    # equal load: the backend without data wins the comparison
    assert {bal.pick(0.0, ttft=ttfts.get) for _ in range(50)} == {"new"}
    # but load still counts
    bal.on_start("new")
    assert {bal.pick(0.0, ttft=ttfts.get) for _ in range(50)} == {"known"}


def test_weights_respected_statistically() -> None:
    bal = make(backend("a", weight=1.0), backend("b", weight=1.0), backend("c", weight=2.0))
    counts = Counter(bal.pick(0.0, ttft=unknown) for _ in range(8000))
    assert counts["c"] / 8000 == pytest.approx(0.5, abs=0.03)
    assert counts["a"] / 8000 == pytest.approx(0.25, abs=0.03)
    assert counts["b"] / 8000 == pytest.approx(0.25, abs=0.03)


def test_zero_weights_do_not_crash() -> None:
    # the settings model refuses weight 0 (weights are > 0); the balancer still must not
    # divide by zero should one reach it, so these two are set past the model's checks
    zero = [backend("a"), backend("b")]
    for entry in zero:
        object.__setattr__(entry, "weight", 0.0)
    bal = make(*zero)
    assert {bal.pick(0.0, ttft=unknown) for _ in range(50)} == {"a", "b"}


def test_exclude() -> None:
    bal = make(backend("a"), backend("b"), backend("c"))
    picks = {bal.pick(0.0, exclude={"a", "b"}, ttft=unknown) for _ in range(20)}
    assert picks == {"c"}
    assert bal.pick(0.0, exclude=["a", "b", "c"], ttft=unknown) is None


def test_avoid_groups_prefers_another_group_but_falls_back() -> None:
    bal = make(
        backend("a1", group="east"),
        backend("a2", group="east"),
        backend("b1", group="west"),
    )
    assert bal.group("b1") == "west"
    picks = {bal.pick(0.0, exclude={"a1"}, avoid_groups={"east"}, ttft=unknown) for _ in range(30)}
    assert picks == {"b1"}
    # no candidate outside the avoided group: any usable one will do
    picks = {
        bal.pick(0.0, exclude={"a1", "b1"}, avoid_groups={"east"}, ttft=unknown) for _ in range(30)
    }
    assert picks == {"a2"}
    # backends without a group label ("") are all in the same group
    plain = make(backend("x"), backend("y"))
    assert plain.pick(0.0, exclude={"x"}, avoid_groups={""}, ttft=unknown) == "y"


def test_max_concurrency() -> None:
    bal = make(backend("a", max_concurrency=2), backend("b"))
    bal.on_start("a")
    bal.on_start("a")
    assert bal.usable(0.0) == ["b"]
    assert {bal.pick(0.0, ttft=unknown) for _ in range(20)} == {"b"}
    assert bal.pick(0.0, exclude={"b"}, ttft=unknown) is None
    bal.on_finish("a")
    assert bal.usable(0.0) == ["a", "b"]


def test_on_finish_never_goes_negative() -> None:
    bal = make(backend("a"))
    bal.on_finish("a")
    assert bal.inflight("a") == 0


def fail(bal: Balancer, name: str, now: float, times: int) -> None:
    """`times` attempts on `name`, one after the other, each failing (the race's order: the
    attempt ends, then its failure counts)."""
    for _ in range(times):
        probe = bal.on_start(name)
        bal.on_finish(name, probe=probe)
        bal.on_failure(name, now)


def test_ejection_after_consecutive_failures() -> None:
    bal = make(backend("a"), backend("b"))
    fail(bal, "a", 10.0, 2)
    assert bal.state("a", 10.0) == ("ok", None)
    bal.on_success("a", 10.0)  # a success breaks the run
    fail(bal, "a", 10.0, 2)
    assert bal.state("a", 10.0) == ("ok", None)
    fail(bal, "a", 10.0, 1)
    state, reason = bal.state("a", 10.0)
    assert state == "ejected"
    assert reason is not None and "3 consecutive failures" in reason
    assert bal.usable(10.0) == ["b"]
    assert {bal.pick(10.0, ttft=unknown) for _ in range(20)} == {"b"}
    assert bal.usable(14.9) == ["b"]
    assert bal.usable(15.0) == ["a", "b"]


def test_single_probe_after_cooldown() -> None:
    bal = make(backend("a"), backend("b"))
    fail(bal, "a", 0.0, 3)
    assert bal.state("a", 5.0) == ("ejected", "cool-down over, awaiting probe")
    assert bal.pick(5.0, exclude={"b"}, ttft=unknown) == "a"
    assert bal.on_start("a")  # the probe
    assert bal.state("a", 5.0) == ("ejected", "probe in flight")
    assert bal.usable(5.0) == ["b"]
    assert bal.pick(5.0, exclude={"b"}, ttft=unknown) is None
    bal.on_success("a", 5.5)
    bal.on_finish("a", probe=1)
    assert bal.state("a", 5.5) == ("ok", None)
    assert bal.usable(5.5) == ["a", "b"]


def test_probe_cancelled_without_verdict_frees_the_slot() -> None:
    bal = make(backend("a"))
    fail(bal, "a", 0.0, 3)
    probe = bal.on_start("a")
    bal.on_finish("a", probe=probe)  # cancelled as a loser: neither success nor failure
    assert bal.usable(6.0) == ["a"]
    assert bal.state("a", 6.0) == ("ejected", "cool-down over, awaiting probe")


def test_cooldown_grows_with_repeated_ejections_up_to_max() -> None:
    bal = make(backend("a"))
    fail(bal, "a", 0.0, 3)  # 1st ejection: 5 s
    assert bal.usable(4.9) == []
    now = 5.0
    expected = [10.0, 20.0, 20.0, 20.0]  # doubling, capped at max_cooldown
    for cooldown in expected:
        assert bal.usable(now) == ["a"]
        fail(bal, "a", now, 1)  # the probe fails: ejected again, longer
        assert bal.usable(now + cooldown - 0.01) == []
        assert bal.usable(now + cooldown) == ["a"]
        now += cooldown
    # a success resets the ejection count: the next ejection is back to 5 s
    bal.on_start("a")
    bal.on_success("a", now)
    bal.on_finish("a")
    fail(bal, "a", now, 3)
    assert bal.usable(now + 4.9) == []
    assert bal.usable(now + 5.0) == ["a"]


def test_failures_during_cooldown_do_not_extend_it() -> None:
    bal = make(backend("a"))
    for _ in range(5):  # five attempts were running when things went wrong
        bal.on_start("a")
    for _ in range(3):
        bal.on_failure("a", 0.0)
        bal.on_finish("a")
    assert bal.usable(0.0) == []
    bal.on_failure("a", 2.0)  # stragglers failing during the cool-down
    bal.on_failure("a", 3.0)
    bal.on_finish("a")
    bal.on_finish("a")
    assert bal.usable(5.0) == ["a"]


def test_very_long_outage_does_not_overflow() -> None:
    bal = make(backend("a"))
    now = 0.0
    fail(bal, "a", now, 3)
    for _ in range(3000):
        now += 20.0
        fail(bal, "a", now, 1)
    assert bal.usable(now + 19.9) == []
    assert bal.usable(now + 20.0) == ["a"]


def test_pause_and_expiry() -> None:
    bal = make(backend("a"), backend("b"))
    bal.pause("a", 20.0, now=10.0)
    assert bal.state("a", 10.0) == ("paused", "retry-after")
    assert bal.seconds_left("a", 10.0) == 20.0
    assert bal.usable(10.0) == ["b"]
    assert bal.pick(10.0, exclude={"b"}, ttft=unknown) is None
    bal.pause("a", 10.0, now=10.0)  # a shorter pause does not cut the longer one short
    assert bal.usable(25.0) == ["b"]
    assert bal.usable(30.0) == ["a", "b"]
    assert bal.state("a", 30.0) == ("ok", None)


def test_ejection_reported_over_pause() -> None:
    bal = make(backend("a"))
    bal.pause("a", 20.0, now=0.0)
    fail(bal, "a", 0.0, 3)
    assert bal.state("a", 1.0)[0] == "ejected"
    # after the cool-down and a successful probe, the pause still applies
    bal.on_success("a", 6.0)
    assert bal.state("a", 6.0)[0] == "paused"
    assert bal.usable(6.0) == []


def test_deterministic_with_a_seed() -> None:
    def run(seed: int) -> list[str | None]:
        bal = make(backend("a"), backend("b"), backend("c"), seed=seed)
        return [bal.pick(0.0, ttft=unknown) for _ in range(30)]

    assert run(7) == run(7)


# -- bounded pauses, panic routing, one probe -------------------------------------


def make_health(*backends: BackendSettings, **health: float) -> Balancer:
    return Balancer(backends, HealthSettings(**health), random.Random(1))  # type: ignore[arg-type]


def test_a_pause_is_at_most_max_pause() -> None:
    bal = make_health(backend("a"), backend("b"), max_pause=30.0)
    bal.pause("a", 999999.0, now=100.0)
    assert bal.seconds_left("a", 100.0) == 30.0
    assert bal.usable(129.9) == ["b"]
    assert bal.usable(130.0) == ["a", "b"]
    assert bal.capped_pause(999999.0) == 30.0
    assert bal.capped_pause(-3.0) == 0.0
    assert bal.capped_pause(1.5) == 1.5


def test_seconds_left_for_every_state() -> None:
    bal = make(backend("a"), backend("b"))
    assert bal.seconds_left("a", 0.0) is None
    fail(bal, "a", 0.0, 3)  # ejected for 5 s
    assert bal.seconds_left("a", 1.0) == 4.0
    assert bal.seconds_left("a", 7.0) == 0.0  # cool-down over: only the probe is awaited
    bal.pause("b", 2.5, now=1.0)
    assert bal.seconds_left("b", 2.0) == 1.5
    assert bal.seconds_left("b", 3.5) is None


def test_a_one_backend_pool_is_never_refused_for_health() -> None:
    bal = make(backend("a"))
    bal.pause("a", 30.0, now=0.0)
    assert bal.panic(1.0)
    assert bal.pick(1.0, ttft=unknown) == "a"
    fail(bal, "a", 2.0, 3)  # ejected as well
    assert bal.pick(3.0, ttft=unknown) == "a"
    bal.on_start("a")  # the probe, in flight
    assert bal.pick(3.0, ttft=unknown) == "a"


def test_panic_needs_fewer_healthy_than_the_threshold_by_weight() -> None:
    bal = make(backend("a", weight=1.0), backend("b", weight=1.0), backend("c", weight=2.0))
    bal.pause("c", 10.0, now=0.0)
    assert not bal.panic(0.0)  # a and b: half the weight, not below it
    assert bal.pick(0.0, exclude={"a", "b"}, ttft=unknown) is None
    bal.pause("b", 10.0, now=0.0)
    assert bal.panic(0.0)  # a alone: a quarter of the weight
    assert bal.pick(0.0, exclude={"a"}, ttft=unknown) in {"b", "c"}
    assert not bal.panic(10.0)


def test_panic_prefers_healthy_then_the_soonest_end() -> None:
    bal = make(backend("a"), backend("b"), backend("c"), backend("d"))
    bal.pause("a", 9.0, now=0.0)
    bal.pause("b", 3.0, now=0.0)
    fail(bal, "c", 0.0, 3)  # ejected until 5.0
    assert bal.panic(1.0)
    assert {bal.pick(1.0, ttft=unknown) for _ in range(20)} == {"d"}
    assert bal.pick(1.0, exclude={"d"}, ttft=unknown) == "b"
    assert bal.pick(1.0, exclude={"d", "b"}, ttft=unknown) == "c"
    assert bal.pick(1.0, exclude={"d", "b", "c"}, ttft=unknown) == "a"


def test_panic_keeps_max_concurrency() -> None:
    bal = make(backend("a", max_concurrency=1), backend("b", max_concurrency=1))
    bal.pause("a", 5.0, now=0.0)
    bal.pause("b", 9.0, now=0.0)
    bal.on_start("a")
    assert bal.pick(1.0, ttft=unknown) == "b"  # a ends sooner, but it is full
    bal.on_start("b")
    assert bal.pick(1.0, ttft=unknown) is None


def test_panic_below_zero_switches_panic_off() -> None:
    bal = make_health(backend("a"), panic_below=0.0)
    bal.pause("a", 5.0, now=0.0)
    assert not bal.panic(1.0)
    assert bal.pick(1.0, ttft=unknown) is None


def test_panic_prefers_another_group_among_the_unhealthy() -> None:
    bal = make(backend("a1", group="east"), backend("a2", group="east"),
               backend("b1", group="west"))
    bal.pause("a2", 1.0, now=0.0)
    bal.pause("b1", 2.0, now=0.0)
    assert bal.pick(0.5, exclude={"a1"}, avoid_groups={"east"}, ttft=unknown) == "b1"


def test_only_the_probe_ending_frees_the_probe_slot() -> None:
    """An attempt that was already running when its backend was ejected
    ends while the probe runs; that must not let a second probe in (one probe)."""
    bal = make(backend("a"), backend("b"))
    old = bal.on_start("a")  # running when the failures come in
    assert not old
    fail(bal, "a", 0.0, 3)  # ejected until 5.0
    assert bal.pick(5.0, exclude={"b"}, ttft=unknown) == "a"
    probe = bal.on_start("a")
    assert probe  # the probe
    bal.on_finish("a", probe=old)  # the old attempt ends, the probe still runs
    assert bal.state("a", 5.0) == ("ejected", "probe in flight")
    assert bal.pick(5.0, exclude={"b"}, ttft=unknown) is None
    assert not bal.on_start("b")
    bal.on_finish("a", probe=probe)  # the probe ends without a verdict
    assert bal.pick(5.0, exclude={"b"}, ttft=unknown) == "a"


def test_a_winning_probe_that_ends_later_does_not_free_a_newer_probes_slot() -> None:
    """The probe wins (its stream goes on), the backend is ejected again by other failures,
    its cool-down ends and a new probe starts: the first probe's stream ending then must not
    let a second probe in beside the new one."""
    bal = make(backend("a"), backend("b"))
    fail(bal, "a", 0.0, 3)  # ejected until 5.0
    first = bal.on_start("a")
    assert first  # the probe
    bal.on_success("a", 5.1)  # its first token: it commits and streams on
    fail(bal, "a", 6.0, 3)  # other requests fail there: ejected until 11.0
    second = bal.on_start("a")
    assert second and second != first  # 11.0: the new probe
    bal.on_finish("a", probe=first)  # the first probe's stream ends
    assert bal.state("a", 11.0) == ("ejected", "probe in flight")
    assert bal.pick(11.0, exclude={"b"}, ttft=unknown) is None  # no second probe
    bal.on_finish("a", probe=second)
    assert bal.pick(11.0, exclude={"b"}, ttft=unknown) == "a"


def test_a_failure_after_the_cooldown_keeps_the_probe_slot_taken() -> None:
    bal = make(backend("a"), backend("b"))
    old = bal.on_start("a")
    fail(bal, "a", 0.0, 3)  # ejected until 5.0
    probe = bal.on_start("a")
    bal.on_finish("a", probe=old)
    bal.on_failure("a", 6.0)  # the old attempt's failure: ejected again, until 16.0
    assert bal.usable(16.0) == ["b"]  # the probe is still running
    bal.on_finish("a", probe=probe)
    assert bal.usable(16.0) == ["a", "b"]


def test_panic_weighs_only_the_backends_that_serve_the_route() -> None:
    """A pool that mixes providers: its one chat backend is paused, its two Messages backends
    are healthy. For a chat request the Messages backends are `outside`: the route's own
    backends are all paused, so selection panics and tries the paused one instead of refusing
    the request untried because the pool as a whole looks healthy."""
    bal = make_health(backend("chat"), backend("claude-a"), backend("claude-b"))
    bal.pause("chat", 10.0, now=0.0)
    ttft = lambda _: None  # noqa: E731
    outside = {"claude-a", "claude-b"}
    assert not bal.panic(1.0)  # the whole pool: two of three healthy
    assert bal.panic(1.0, outside=outside)
    assert bal.pick(1.0, ttft=ttft, outside=outside) == "chat"
    # never a backend outside the route, panic or not
    bal.pause("claude-a", 10.0, now=0.0)
    assert bal.pick(1.0, ttft=ttft, outside={"chat", "claude-a"}) == "claude-b"
    # half the route's weight healthy is not panic: claude-b busy with this request's
    # attempt leaves no healthy choice, and the paused one is not tried
    assert bal.pick(1.0, ttft=ttft, exclude={"claude-b"}, outside={"chat"}) is None
