"""Windowed and lifetime latency sketches, driven by a plain-number clock."""

from __future__ import annotations

import math

import pytest

from gateway.hedge.latency import FLOOR, LifetimeSketch, WindowedSketch


def test_empty_window_has_no_quantiles() -> None:
    sketch = WindowedSketch(60.0)
    assert sketch.quantile(0.5, now=0.0) is None
    assert sketch.quantiles([0.5, 0.99], now=0.0) == [None, None]
    assert sketch.count(0.0) == 0


def test_quantiles_within_relative_accuracy() -> None:
    sketch = WindowedSketch(60.0)
    for i in range(1, 1001):  # 1 ms .. 1000 ms
        sketch.add(i / 1000, now=i * 0.01)
    p50, p95, p99 = sketch.quantiles([0.5, 0.95, 0.99], now=10.0)
    assert p50 == pytest.approx(0.5, rel=0.02)
    assert p95 == pytest.approx(0.95, rel=0.02)
    assert p99 == pytest.approx(0.99, rel=0.02)
    assert sketch.quantile(0.95, now=10.0) == p95
    assert sketch.count(10.0) == 1000


def test_samples_older_than_the_window_drop_out() -> None:
    sketch = WindowedSketch(60.0, slices=6)  # 10 s slices
    sketch.add(5.0, now=0.0)  # slice 0
    sketch.add(0.1, now=35.0)  # slice 3
    assert sketch.count(59.9) == 2
    # at 60 s the ring covers slices 1..6: the slow sample from slice 0 is gone
    assert sketch.count(60.0) == 1
    assert sketch.quantile(0.99, now=60.0) == pytest.approx(0.1, rel=0.02)
    # nothing younger than window - slice width is ever dropped
    assert sketch.count(85.0) == 1
    assert sketch.count(95.0) == 0
    assert sketch.quantile(0.5, now=95.0) is None


def test_slots_are_recycled_when_the_ring_wraps() -> None:
    sketch = WindowedSketch(6.0, slices=3)  # 2 s slices
    for t in range(100):
        sketch.add(1.0 if t < 50 else 2.0, now=float(t))
    # only the last 6 s (all 2.0) are held
    assert sketch.count(99.0) == 6
    assert sketch.quantile(0.0, now=99.0) == pytest.approx(2.0, rel=0.02)


def test_a_value_stamped_before_the_window_is_dropped() -> None:
    sketch = WindowedSketch(60.0, slices=6)
    sketch.add(1.0, now=100.0)
    sketch.add(9.0, now=10.0)  # older than anything the window can show
    assert sketch.count(100.0) == 1
    assert sketch.quantile(1.0, now=100.0) == pytest.approx(1.0, rel=0.02)


def test_reads_see_adds_made_after_a_cached_merge() -> None:
    sketch = WindowedSketch(60.0)
    sketch.add(1.0, now=1.0)
    assert sketch.quantile(0.5, now=1.0) == pytest.approx(1.0, rel=0.02)
    sketch.add(3.0, now=1.5)
    sketch.add(3.0, now=1.5)
    assert sketch.quantile(0.5, now=1.5) == pytest.approx(3.0, rel=0.02)


def test_zero_and_tiny_values_are_floored_and_read_back_as_floats() -> None:
    sketch = WindowedSketch(60.0)
    for value in (0.0, 1e-300, -0.5, 5e-7):
        sketch.add(value, now=0.0)
    q = sketch.quantile(0.5, now=0.0)
    assert isinstance(q, float)
    assert q == pytest.approx(FLOOR, rel=0.02)
    lifetime = LifetimeSketch()
    lifetime.add(0.0)
    (q0,) = lifetime.quantiles([0.5])
    assert isinstance(q0, float)
    assert q0 == pytest.approx(FLOOR, rel=0.02)


def test_zero_does_not_blow_up_the_store() -> None:
    # 1e-300 next to 100 s would need ~35000 dense bins without the floor
    sketch = WindowedSketch(60.0)
    sketch.add(1e-300, now=0.0)
    sketch.add(100.0, now=0.0)
    assert sketch.quantile(1.0, now=0.0) == pytest.approx(100.0, rel=0.02)
    store = sketch._sketches[0]._store
    assert len(store.bins) < 2100


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_rejected(bad: float) -> None:
    with pytest.raises(ValueError):
        WindowedSketch(60.0).add(bad, now=0.0)
    with pytest.raises(ValueError):
        LifetimeSketch().add(bad)


def test_out_of_range_quantile_is_rejected() -> None:
    with pytest.raises(ValueError):
        WindowedSketch(60.0).quantile(1.5, now=0.0)
    with pytest.raises(ValueError):
        LifetimeSketch().quantiles([-0.1])


def test_bad_construction_is_rejected() -> None:
    with pytest.raises(ValueError):
        WindowedSketch(0.0)
    with pytest.raises(ValueError):
        WindowedSketch(10.0, slices=0)


def test_lifetime_sketch_keeps_everything() -> None:
    sketch = LifetimeSketch()
    assert sketch.count == 0
    assert sketch.quantiles([0.5]) == [None]
    assert sketch.quantile(0.5) is None
    for i in range(1, 101):
        sketch.add(i / 100)
    assert sketch.count == 100
    p50, p99 = sketch.quantiles([0.5, 0.99])
    assert p50 == pytest.approx(0.5, rel=0.03)
    assert p99 == pytest.approx(0.99, rel=0.03)
