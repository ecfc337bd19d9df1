"""`tune_collector`: the thresholds `hedge-gateway serve` runs with, and the start-up heap
frozen out of the collector's sight (run in a child, so this process keeps its own)."""

from __future__ import annotations

import json
import subprocess
import sys

from gateway.server.serve import COLLECTOR_THRESHOLDS

CHILD = """
import gc, json
before = gc.get_threshold()
from gateway.app import create_app
from gateway.settings.load import default_settings
from gateway.server.serve import tune_collector
app = create_app(default_settings())
tune_collector()
print(json.dumps({"before": before, "after": gc.get_threshold(),
                  "frozen": gc.get_freeze_count()}))
"""


def test_serving_collects_young_objects_less_often_and_never_walks_the_start_up_heap() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert tuple(seen["before"]) != COLLECTOR_THRESHOLDS  # CPython's defaults, not ours
    assert tuple(seen["after"]) == COLLECTOR_THRESHOLDS
    assert seen["after"][0] >= 50 * seen["before"][0]
    assert seen["frozen"] > 10_000  # the modules, the app and its configuration
