"""The dashboard in a real headless Chromium: a gateway under uvicorn, simulated
backends with many stragglers (so hedges start and win), OpenAI SDK traffic while the page is
open. The page must render data, update itself, log no script error, and load nothing from
outside the gateway.

Set HEDGE_DASHBOARD_SCREENSHOT=path.png to also save a screenshot (the README's picture is
made that way).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.dashboard import CSP
from gateway.settings import (
    BackendSettings,
    BudgetSettings,
    DelaySettings,
    HedgingSettings,
    PoolSettings,
    ServerSettings,
    Settings,
    SimProfile,
)
from tests.e2e.test_workers import (
    chat,
    two_workers,  # noqa: F401  (the fixture, asked for by name)
)
from tests.harness import AsgiServerFactory, RunningServer
from tests.harness.browser import Browser, PageLog, find_chromium

POOL = "demo"
CHROMIUM = find_chromium()
SKIP_REASON = (
    "no chromium binary: .ci/run installs Debian's `chromium` when apt can, and here it "
    "could not; the browser test needs a real browser"
)
#: a third of the requests straggle 0.6 s before their first token; hedges go after 0.15 s
PROFILE = SimProfile(
    ttft_median=0.04, ttft_sigma=0.3, straggler_probability=0.35, straggler_extra=0.6,
    tokens=12, inter_token=0.002,
)


def sim_settings() -> Settings:
    backends = tuple(
        BackendSettings(name, "sim", "sim-model", group=name,
                        sim=dataclasses.replace(PROFILE, seed=seed))
        for seed, name in enumerate(("sim-a", "sim-b"))
    )
    hedging = HedgingSettings(
        max_attempts=2,
        delay=DelaySettings(mode="fixed", value=0.15),
        budget=BudgetSettings(ratio=0.5, burst=50),
    )
    return Settings((PoolSettings(POOL, backends, hedging=hedging),))


def send_traffic(gateway: RunningServer, stop: threading.Event) -> int:
    """Streamed chat requests one after another until `stop`; how many finished."""
    done = 0
    with openai.OpenAI(base_url=gateway.v1, api_key="sk-none", max_retries=0,
                       timeout=openai.Timeout(20.0)) as client:
        while not stop.is_set():
            stream = client.chat.completions.create(
                model=POOL, messages=[{"role": "user", "content": "tell me a story"}],
                stream=True,
            )
            for _ in stream:
                pass
            done += 1
    return done


FACTS = """({
  pools: document.querySelectorAll('section.pool').length,
  lines: document.querySelectorAll('path.line').length,
  bars: document.querySelectorAll('svg.timeline rect.bar').length,
  hedgeBars: document.querySelectorAll('svg.timeline rect.bar-hedge').length,
  winners: document.querySelectorAll('svg.timeline .winmark').length,
  backendRows: document.querySelectorAll('table.backends tr').length - 1,
  states: Array.from(document.querySelectorAll('table.backends td[class^=state-]'))
    .map((td) => td.textContent),
  tiles: Object.fromEntries(Array.from(document.querySelectorAll('.tile'))
    .map((t) => [t.querySelector('.k').textContent, t.querySelector('.v').textContent])),
  updates: Number(document.body.dataset.updates),
  uptime: document.getElementById('uptime').textContent,
})"""


async def drive(origin: str, screenshot: Path | None) -> tuple[dict[str, Any],
                                                                dict[str, Any], PageLog]:
    assert CHROMIUM is not None
    browser = Browser(CHROMIUM)
    try:
        await browser.start()
        await browser.call("Page.navigate", {"url": f"{origin}/dashboard"})
        # data arrived: a hedge overtook a straggler on the timeline, winners are marked
        await browser.wait_for(
            "document.querySelectorAll('svg.timeline rect.bar-hedge.winner').length > 0 && "
            "Number(document.body.dataset.updates) >= 3", timeout=40.0)
        first = await browser.evaluate(FACTS)
        await browser.wait_for(f"Number(document.body.dataset.updates) >= {first['updates'] + 2}")
        second = await browser.evaluate(FACTS)
        if screenshot is not None:
            await browser.screenshot(screenshot, 1280, 1500)
        return first, second, browser.log
    finally:
        await browser.close()


@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
@pytest.mark.timeout(150)
def test_dashboard_shows_live_races_in_a_real_browser(asgi_server: AsgiServerFactory) -> None:
    gateway = asgi_server.build(lambda: create_app(sim_settings(), seed=5))
    origin = gateway.url("").rstrip("/")
    page = httpx.get(f"{origin}/dashboard", timeout=10.0)
    assert page.status_code == 200 and page.headers["content-security-policy"] == CSP
    shot = os.environ.get("HEDGE_DASHBOARD_SCREENSHOT")
    stop = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        senders = [pool.submit(send_traffic, gateway, stop) for _ in range(3)]
        try:
            first, second, log = asyncio.run(drive(origin, Path(shot) if shot else None))
        finally:
            stop.set()
            sent = sum(f.result(timeout=60) for f in senders)
    assert sent > 0
    assert log.errors == []
    # everything the page loaded came from the gateway (the page, its script and style, and
    # the JSON it polls); nothing from elsewhere
    assert log.requests, "the browser reported no request at all"
    outside = [url for url in log.requests if not url.startswith(origin + "/")]
    assert outside == []
    loaded = {url[len(origin):].split("?")[0] for url in log.requests}
    assert {"/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css",
            "/hedge/stats", "/hedge/series", "/hedge/races"} <= loaded
    # it rendered data: one pool, TTFT and rate lines, a timeline with hedges and winners,
    # both backends with their state, token counts
    assert second["pools"] == 1
    assert second["lines"] >= 4
    assert second["bars"] > 0 and second["hedgeBars"] > 0 and second["winners"] > 0
    assert second["backendRows"] == 2 and set(second["states"]) <= {"ok", "paused", "ejected"}
    tokens_in, tokens_out = second["tiles"]["tokens in / out"].split(" / ")
    assert float(tokens_in.rstrip("k")) > 0 and float(tokens_out.rstrip("k")) > 0
    assert float(second["tiles"]["hedge cost (input tokens)"].rstrip("k")) > 0
    # short prompts get no conversation key: affinity counts them as misses
    hits, spills, misses = second["tiles"]["affinity hit / spill / miss"].split(" / ")
    assert (hits, spills) == ("0", "0") and float(misses.rstrip("k")) > 0
    assert "prompt cache hit rate" in second["tiles"]
    # and it updated itself while it was open
    assert second["updates"] >= first["updates"] + 2
    assert second["uptime"] != first["uptime"]


#: the workers named on the timeline's bars (each bar's tooltip ends with its worker)
RACE_WORKERS = """Array.from(new Set(Array.from(
  document.querySelectorAll('svg.timeline rect.bar title'))
  .map((t) => (t.textContent.match(/worker (\\d+)$/) || [])[1]).filter((w) => w)))
  .sort()"""


async def drive_workers(origin: str) -> tuple[list[int], PageLog]:
    """Open the page on a two-worker server until its timeline shows races of both workers;
    then the points it keeps over five more updates."""
    assert CHROMIUM is not None
    browser = Browser(CHROMIUM)
    try:
        await browser.start()
        await browser.call("Page.navigate", {"url": f"{origin}/dashboard"})
        await browser.wait_for(f"JSON.stringify({RACE_WORKERS}) === '[\"0\",\"1\"]'",
                               timeout=40.0)
        kept = []
        for _ in range(5):
            updates = await browser.evaluate("Number(document.body.dataset.updates)")
            await browser.wait_for(f"Number(document.body.dataset.updates) > {updates}")
            kept.append(await browser.evaluate("Number(document.body.dataset.points)"))
        return kept, browser.log
    finally:
        await browser.close()


@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
@pytest.mark.timeout(150)
def test_the_dashboard_of_two_workers_shows_both(
    two_workers: tuple[subprocess.Popen[bytes], str, Path],  # noqa: F811
) -> None:
    """`serve --workers 2`: whichever worker answers the page's polls, the timeline holds the
    races of both workers, and a worker answering a point behind its peer does not make the
    page drop the points it has."""
    _proc, root, _log = two_workers
    stop = threading.Event()

    def traffic() -> int:
        done = 0
        while not stop.is_set():
            chat(root)  # a connection each: the kernel spreads them over the workers
            done += 1
        return done

    with ThreadPoolExecutor(2) as pool:
        senders = [pool.submit(traffic) for _ in range(2)]
        try:
            kept, log = asyncio.run(drive_workers(root))
        finally:
            stop.set()
            sent = sum(f.result(timeout=60) for f in senders)
    assert sent > 0
    assert log.errors == []
    assert kept == sorted(kept) and kept[0] > 0, kept  # points only ever added


async def drive_with_key(origin: str, authorization: str) -> tuple[dict[str, Any], PageLog]:
    """The page opened by a browser that holds the ops key (as after the Basic prompt)."""
    assert CHROMIUM is not None
    browser = Browser(CHROMIUM)
    try:
        await browser.start()
        await browser.call("Network.setExtraHTTPHeaders",
                           {"headers": {"Authorization": authorization}})
        await browser.call("Page.navigate", {"url": f"{origin}/dashboard"})
        await browser.wait_for("document.body !== null && "
                               "Number(document.body.dataset.updates) >= 2", timeout=40.0)
        return await browser.evaluate(FACTS), browser.log
    finally:
        await browser.close()


@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
@pytest.mark.timeout(120)
def test_dashboard_behind_ops_keys_works_in_a_real_browser_that_holds_the_key(
    asgi_server: AsgiServerFactory,
) -> None:
    settings = dataclasses.replace(
        sim_settings(), server=ServerSettings(ops_keys=("ops-key-0001",)))
    gateway = asgi_server.build(lambda: create_app(settings, seed=5))
    origin = gateway.url("").rstrip("/")
    refused = httpx.get(f"{origin}/dashboard", timeout=10.0)
    assert refused.status_code == 401 and "basic" in refused.headers["www-authenticate"].lower()
    basic = "Basic " + base64.b64encode(b"ops:ops-key-0001").decode()
    facts, log = asyncio.run(drive_with_key(origin, basic))
    assert log.errors == []
    assert facts["pools"] == 1 and facts["updates"] >= 2
    loaded = {url[len(origin):].split("?")[0] for url in log.requests}
    assert {"/hedge/stats", "/hedge/series", "/hedge/races"} <= loaded
