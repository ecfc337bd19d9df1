"""Quota headroom on the dashboard, in a real headless Chromium: one simulated backend has a
small request quota that it states in rate-limit headers; under OpenAI SDK traffic it runs
low, and the page must show it `low`, with the share of its quota left and the choices that
skipped it, as `/hedge/stats` says.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.settings import BackendSettings, HealthSettings, PoolSettings, Settings
from tests.e2e.test_dashboard import CHROMIUM, PROFILE, SKIP_REASON, send_traffic
from tests.harness import AsgiServerFactory
from tests.harness.browser import Browser, PageLog

POOL = "demo"
#: sim-b's quota, for an hour (it does not reset during the test); with `min_headroom` at a
#: half, sim-b is low once it has answered half of it, long before it would refuse (429)
QUOTA = 40

ROWS = """Array.from(document.querySelectorAll('table.backends tr')).slice(1).map((tr) => {
  const cells = Array.from(tr.querySelectorAll('td')).map((td) => td.textContent);
  return {name: cells[0], state: cells[1], headroom: cells[2], skips: cells[3]};
})"""


def quota_settings() -> Settings:
    quota = dataclasses.replace(PROFILE, seed=1, rate_limit_requests=QUOTA,
                                rate_limit_window=3600.0)
    backends = (
        BackendSettings("sim-a", "sim", "sim-model", group="a",
                        sim=dataclasses.replace(PROFILE, seed=0)),
        BackendSettings("sim-b", "sim", "sim-model", group="b", sim=quota),
    )
    return Settings((PoolSettings(POOL, backends, health=HealthSettings(min_headroom=0.5)),))


async def drive(origin: str) -> tuple[list[dict[str, Any]], PageLog]:
    assert CHROMIUM is not None
    browser = Browser(CHROMIUM)
    try:
        await browser.start()
        await browser.call("Page.navigate", {"url": f"{origin}/dashboard"})
        await browser.wait_for(
            f"{ROWS}.some((r) => r.name === 'sim-b' && r.state.startsWith('low') "
            "&& Number(r.skips) > 0)", timeout=60.0)
        return await browser.evaluate(ROWS), browser.log
    finally:
        await browser.close()


@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
@pytest.mark.timeout(150)
def test_the_dashboard_shows_a_backend_low_on_quota(asgi_server: AsgiServerFactory) -> None:
    gateway = asgi_server.build(lambda: create_app(quota_settings(), seed=5))
    origin = gateway.url("").rstrip("/")
    stop = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        senders = [pool.submit(send_traffic, gateway, stop) for _ in range(2)]
        try:
            rows, log = asyncio.run(drive(origin))
        finally:
            stop.set()
            sent = sum(f.result(timeout=60) for f in senders)
    assert sent > 0 and log.errors == []
    by_name = {row["name"]: row for row in rows}
    low, other = by_name["sim-b"], by_name["sim-a"]
    # the share of its quota left, as its last rate-limit headers said, and what it was of
    share = float(low["headroom"].split(" %")[0])
    assert 0.0 < share < 50.0 and "requests" in low["headroom"]
    assert other["state"] == "ok" and other["headroom"] == "\u2013"  # a dash: sim-a states no quota
    # the page shows what the stats say
    stats = httpx.get(f"{origin}/hedge/stats", timeout=10.0).json()
    backend = stats["pools"][POOL]["backends"]["sim-b"]
    assert backend["state"] == "low"
    assert backend["lifetime"]["headroom_skips"] >= int(low["skips"]) > 0
