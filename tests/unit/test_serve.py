"""`tune_collector`: the thresholds `hedge-gateway serve` runs with, and the start-up heap
frozen out of the collector's sight (run in a child, so this process keeps its own)."""

from __future__ import annotations

import json
import subprocess
import sys

from gateway.server.serve import COLLECTOR_YOUNG_FLOOR, collector_thresholds
from gateway.settings.load import default_settings

CHILD = """
import gc, json
before = gc.get_threshold()
from gateway.app import create_app
from gateway.settings.load import default_settings
from gateway.server.serve import tune_collector
settings = default_settings()
app = create_app(settings)
tune_collector(settings.server)
print(json.dumps({"before": before, "after": gc.get_threshold(),
                  "frozen": gc.get_freeze_count()}))
"""

#: a burst of `admitted` requests, each holding 150 container objects alive until its first
#: byte (a streamed chat completion holds about that many): the young collections it meets
BURST = """
import gc, json
from gateway.settings import ServerSettings
from gateway.server.serve import tune_collector
admitted = 1000
tune_collector(ServerSettings(max_concurrent_requests=admitted))
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info))
live = [[{"request": r, "object": k} for k in range(75)] for r in range(admitted)]
print(json.dumps({"young_collections": len(collections), "live": len(live)}))
"""


def _child(code: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    seen: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return seen


def test_serving_collects_young_objects_less_often_and_never_walks_the_start_up_heap() -> None:
    seen = _child(CHILD)
    before, after = seen["before"], seen["after"]
    assert isinstance(before, list) and isinstance(after, list)
    assert tuple(before) != collector_thresholds(512)  # CPython's defaults, not ours
    assert tuple(after) == collector_thresholds(default_settings().server
                                                .max_concurrent_requests)
    assert after[0] >= 50 * before[0]
    assert isinstance(seen["frozen"], int) and seen["frozen"] > 10_000  # the app, its config


def test_the_young_threshold_holds_a_burst_of_every_request_the_server_admits() -> None:
    """A young collection in the middle of a burst walks every new request's objects (all
    alive) and frees nothing while the burst's first bytes wait; the threshold follows
    `server.max_concurrent_requests`, with a floor, so a full burst meets none."""
    assert collector_thresholds(1)[0] == COLLECTOR_YOUNG_FLOOR
    assert collector_thresholds(512)[0] > COLLECTOR_YOUNG_FLOOR
    assert collector_thresholds(4096)[0] == 8 * collector_thresholds(512)[0]
    assert collector_thresholds(512)[1:] == collector_thresholds(4096)[1:] == (20, 100)
    seen = _child(BURST)
    assert seen == {"young_collections": 0, "live": 1000}
