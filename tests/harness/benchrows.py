"""What the overhead workload prints for a row measured over hedging-on (`keys-1000`,
`translated`: `gateway.bench.variants.OVER_HEDGING_ON`), checked alike for each: its ratio
line, its target, and the target's verdict on a tiny run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_row_over_hedging_on(workload: Mapping[str, Any], printed: str, mode: str) -> None:
    """`mode`'s CPU per request over hedging-on's is printed once, equals the comparison's,
    and its target (`<mode> CPU per request <= 1.10 x hedging-on's`) reads the same value
    and is not judged: a dozen requests are a tick or two of gateway CPU, too few to tell
    10 % apart, and the target says so rather than judging a tick's rounding."""
    target_name = f"{mode} CPU per request <= 1.10 x hedging-on's"
    over = [line for line in printed.splitlines() if f"{mode} / hedging-on: CPU" in line]
    assert len(over) == 1, over
    comparison = workload["comparison"]
    ratio = comparison.get(f"{mode}_cpu_ms_per_request_over_hedging-on")
    if comparison["hedging-on_cpu_ms_per_request"] and comparison[f"{mode}_cpu_ms_per_request"]:
        assert ratio is not None and ratio > 0 and f"x{ratio:.3f}" in over[0]
    else:  # 12 requests may take either under a tick of the process clock: no ratio then
        assert ratio is None and over[0].endswith("xn/a")
    (target,) = [t for t in workload["targets"] if t["target"] == target_name]
    assert target["value"] == ratio
    assert target["met"] is None and "too short to resolve 10 %" in target["not_judged"]
    assert [line for line in printed.splitlines() if target_name in line] == [
        f"   target: {target_name}: {'-' if ratio is None else f'{ratio:.2f}'} -> not judged "
        f"({target['not_judged']})"]
