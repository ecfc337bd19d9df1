"""The tenants' pure core: a key's limits as buckets in virtual time (the clock is a number),
the rate-limit headers both SDK families read, the registry of keys by digest, and the
`keys:` settings (a key kept only as its digest)."""

from __future__ import annotations

import hashlib

import pytest

from gateway.server.workers import worker_settings
from gateway.settings import BackendSettings, ConfigError, PoolSettings, ServerSettings, Settings
from gateway.settings.load import unenforced_keys
from gateway.settings.tenants import (
    TenantBudget,
    TenantHedging,
    TenantKeySettings,
    TenantLimits,
)
from gateway.tenants.headers import Instants, duration_text, instant_text, ratelimit_headers
from gateway.tenants.limits import IN_FLIGHT_RETRY, KeyLimits, Quota, Refusal
from gateway.tenants.registry import Tenants


def limits(**values: int) -> KeyLimits:
    return KeyLimits(TenantLimits(**values), now=0.0)


def admitted(result: Refusal | tuple[Quota, ...]) -> tuple[Quota, ...]:
    assert not isinstance(result, Refusal), result
    return result


def refused(result: Refusal | tuple[Quota, ...]) -> Refusal:
    assert isinstance(result, Refusal), result
    return result


# --- limits ---------------------------------------------------------------------------------


def test_requests_per_minute_is_a_bucket_that_says_when_the_next_request_passes() -> None:
    key = limits(requests_per_minute=2)
    assert admitted(key.admit(0.0, 10)) == (Quota("requests", 2, 1, 30.0),)
    assert admitted(key.admit(0.0, 10)) == (Quota("requests", 2, 0, 60.0),)
    refusal = refused(key.admit(0.0, 10))
    assert refusal.kind == "requests" and refusal.retry_after == 30.0
    assert refused(key.admit(29.9, 10)).retry_after == pytest.approx(0.1)
    assert admitted(key.admit(30.0, 10)) == (Quota("requests", 2, 0, 60.0),)


def test_a_refusal_takes_nothing_from_any_limit() -> None:
    key = limits(requests_per_minute=10, input_tokens_per_minute=100)
    admitted(key.admit(0.0, 40))
    refusal = refused(key.admit(0.0, 80))
    assert refusal.kind == "input_tokens"
    assert key.in_flight == 1
    assert refusal.quotas == (Quota("requests", 10, 9, 6.0), Quota("input_tokens", 100, 60, 24.0))


def test_a_request_larger_than_its_bucket_passes_from_a_full_bucket_only() -> None:
    key = limits(input_tokens_per_minute=100)
    admitted(key.admit(0.0, 40))
    refusal = refused(key.admit(0.0, 150))  # 60 left; it waits until the bucket is full
    assert refusal.retry_after == pytest.approx(40 / (100 / 60))
    key.settle(0.0, 40, None, None, leased=False)
    assert admitted(key.admit(refusal.retry_after, 150))[0].remaining == 0


def test_the_input_estimate_is_corrected_by_the_upstreams_count_at_the_end() -> None:
    key = limits(input_tokens_per_minute=1000)
    assert admitted(key.admit(0.0, 100))[0].remaining == 900
    key.settle(0.0, 100, 300, None, leased=False)  # the upstream counted 300
    assert key.quotas()[0].remaining == 700
    admitted(key.admit(0.0, 100))
    key.settle(0.0, 100, 10, None, leased=False)
    assert key.quotas()[0].remaining == 690


def test_output_tokens_are_charged_at_the_end_and_a_key_in_debt_waits() -> None:
    key = limits(output_tokens_per_minute=60)  # one token a second
    admitted(key.admit(0.0, 5))
    key.settle(0.0, 5, 5, 90, leased=False)  # 30 tokens past the bucket
    refusal = refused(key.admit(0.0, 5))
    assert refusal.kind == "output_tokens"
    assert refusal.retry_after == pytest.approx(30.0)
    assert refused(key.admit(29.0, 5)).retry_after == pytest.approx(1.0)
    assert admitted(key.admit(30.001, 5))[0].kind == "output_tokens"


def test_in_flight_counts_until_the_request_settles() -> None:
    key = limits(in_flight=1)
    assert admitted(key.admit(0.0, 1)) == ()  # no per-minute quota to state
    refusal = refused(key.admit(0.0, 1))
    assert (refusal.kind, refusal.retry_after) == ("in_flight", IN_FLIGHT_RETRY)
    key.settle(5.0, 1, None, None, leased=False)
    admitted(key.admit(5.0, 1))


def test_a_refund_gives_back_everything_the_admission_took() -> None:
    """A request the gateway refused before any upstream: its request, its input estimate
    and its slot go back, never above the bucket's capacity."""
    key = limits(requests_per_minute=1, input_tokens_per_minute=100, in_flight=1)
    before = admitted(key.admit(0.0, 40))
    assert [q.remaining for q in before] == [0, 60]
    key.refund(0.0, 40, leased=False)
    assert [q.remaining for q in key.quotas()] == [1, 100]
    assert key.in_flight == 0
    admitted(key.admit(0.0, 40))  # the minute's one request is still there
    key.refund(59.0, 40, leased=False)  # refilled meanwhile: capped at the capacity
    assert [q.remaining for q in key.quotas()] == [1, 100]


def test_the_longest_wait_is_the_one_advised() -> None:
    key = limits(requests_per_minute=1, output_tokens_per_minute=6)
    admitted(key.admit(0.0, 1))
    key.settle(0.0, 1, None, 66, leased=False)  # 60 in debt: 600 s at 0.1 a second
    refusal = refused(key.admit(0.0, 1))
    assert refusal.kind == "output_tokens" and refusal.retry_after == pytest.approx(600.0)


def test_a_keys_state_is_a_fixed_handful_of_numbers_whatever_its_traffic() -> None:
    key = limits(requests_per_minute=100, input_tokens_per_minute=10_000,
                 output_tokens_per_minute=10_000, in_flight=5)
    assert not hasattr(key, "__dict__")
    for step in range(20_000):
        result = key.admit(step * 0.01, 10)
        if not isinstance(result, Refusal):
            key.settle(step * 0.01, 10, 12, 3, leased=False)
    assert key.in_flight == 0
    assert len(key.quotas()) == 3


# --- headers --------------------------------------------------------------------------------


def test_resets_are_written_as_each_family_writes_them() -> None:
    assert [duration_text(s) for s in (0.25, 1.0, 1.5, 59.9994, 360.0, 61.25)] == [
        "250ms", "1s", "1.5s", "59.999s", "6m0s", "1m1.25s"]
    assert instant_text(0.0) == "1970-01-01T00:00:00Z"


def test_openai_and_anthropic_header_families() -> None:
    quotas = (Quota("requests", 10, 9, 6.0), Quota("input_tokens", 1000, 900, 6.0),
              Quota("output_tokens", 500, 0, 90.0))
    openai = dict(ratelimit_headers(quotas, anthropic=False, wall=0.0))
    assert openai == {
        b"x-ratelimit-limit-requests": b"10", b"x-ratelimit-remaining-requests": b"9",
        b"x-ratelimit-reset-requests": b"6s",
        b"x-ratelimit-limit-tokens": b"1000", b"x-ratelimit-remaining-tokens": b"900",
        b"x-ratelimit-reset-tokens": b"6s",
        b"x-ratelimit-limit-output-tokens": b"500",
        b"x-ratelimit-remaining-output-tokens": b"0",
        b"x-ratelimit-reset-output-tokens": b"1m30s"}
    anthropic = dict(ratelimit_headers(quotas, anthropic=True, wall=100.0))
    assert anthropic[b"anthropic-ratelimit-requests-remaining"] == b"9"
    assert anthropic[b"anthropic-ratelimit-input-tokens-limit"] == b"1000"
    assert anthropic[b"anthropic-ratelimit-output-tokens-reset"] == b"1970-01-01T00:03:10Z"
    assert len(anthropic) == 9
    instants = Instants()  # a gate's: the same headers, each instant written once a second
    assert dict(ratelimit_headers(quotas, anthropic=True, wall=100.0,
                                  instants=instants)) == anthropic
    assert sorted(instants.texts) == [106, 190]
    for second in range(2 * Instants.SIZE):  # bounded however long it serves
        instants.text(float(second))
    assert len(instants.texts) <= Instants.SIZE
    assert instants.text(5.0) == instant_text(5.0).encode()


# --- registry and settings ------------------------------------------------------------------

SECRET = "team-a-secret-key-0123456789abcdef"


def key_settings(**values: object) -> TenantKeySettings:
    return TenantKeySettings(**{"name": "team-a", "key": SECRET, **values})  # type: ignore[arg-type]


def test_a_key_is_kept_only_as_its_digest() -> None:
    key = key_settings()
    assert key.key is None
    assert key.key_sha256 == hashlib.sha256(SECRET.encode()).hexdigest()
    assert SECRET not in repr(key)


def test_a_key_needs_exactly_one_of_key_and_key_sha256() -> None:
    with pytest.raises(ConfigError, match="key_sha256: required"):
        TenantKeySettings(name="x")
    with pytest.raises(ConfigError, match="not both"):
        TenantKeySettings(name="x", key="k", key_sha256="0" * 64)
    with pytest.raises(ConfigError, match="64 hexadecimal"):
        TenantKeySettings(name="x", key_sha256="abc")


def settings_with(*keys: TenantKeySettings, api_keys: tuple[str, ...] = ()) -> Settings:
    pool = PoolSettings("p", (BackendSettings("s", "sim"),))
    return Settings((pool,), server=ServerSettings(api_keys=api_keys), keys=keys)


def test_keys_name_pools_that_exist_and_are_unique() -> None:
    with pytest.raises(ConfigError) as caught:
        settings_with(key_settings(pools=("p", "q")), key_settings(name="team-b"),
                      key_settings(), api_keys=(SECRET,))
    assert caught.value.errors == (
        "keys[0].key_sha256: also listed in server.api_keys",
        "keys[0].pools: no pool named 'q'",
        "keys[1].key_sha256: the same key as keys[0]",
        "keys[2].name: duplicate key name 'team-a' (also keys[0])",
        "keys[2].key_sha256: the same key as keys[0]",
    )


def test_the_registry_finds_a_key_by_its_digest_and_a_reload_keeps_its_state() -> None:
    tenants = Tenants([key_settings(limits=TenantLimits(in_flight=1))], now=0.0)
    assert tenants.find("wrong") is None and tenants.find("") is None
    tenant = tenants.find(SECRET)
    assert tenant is not None and tenant.name == "team-a" and tenant.may_use("any")
    assert tenant.limits is not None
    admitted(tenant.limits.admit(0.0, 1))
    same = Tenants([key_settings(limits=TenantLimits(in_flight=1))], 1.0, tenants)
    kept = same.find(SECRET)
    assert kept is not None and kept.limits is tenant.limits  # its running request counts
    changed = Tenants([key_settings(limits=TenantLimits(in_flight=2))], 1.0, same)
    fresh = changed.find(SECRET)
    assert fresh is not None and fresh.limits is not tenant.limits
    revoked = Tenants([], 2.0, changed)
    assert revoked.find(SECRET) is None
    assert Tenants([key_settings(pools=("p",))], 0.0).find(SECRET).may_use("q") is False  # type: ignore[union-attr]
    assert Tenants([key_settings()], 0.0).find(SECRET).limits is None  # type: ignore[union-attr]


def test_each_worker_leases_the_whole_per_minute_limits_and_holds_its_share_in_flight(
) -> None:
    """The workers of one `serve` lease slices of each per-minute limit from the file they
    share (`gateway.tenants.lease`), so each holds the limit whole; in flight, which no lease
    holds, is split, rounded up."""
    settings = settings_with(key_settings(limits=TenantLimits(
        requests_per_minute=100, input_tokens_per_minute=1001, in_flight=5)))
    (key,) = worker_settings(settings, 4).keys
    assert key.limits == TenantLimits(requests_per_minute=100, input_tokens_per_minute=1001,
                                      in_flight=2)


def test_rules_not_enforced_yet_are_warned_about_never_taken_silently() -> None:
    keys = (key_settings(budget=TenantBudget(usd=5.0), ttft_objective=0.8), key_settings(
        name="plain", key="other-secret", hedging=TenantHedging(enabled=False)),
        key_settings(name="ratio", key="third-secret", hedging=TenantHedging(ratio=0.2)))
    # budget, ttft_objective and hedging.ratio are all enforced now: none is warned about
    assert unenforced_keys(keys) == []
