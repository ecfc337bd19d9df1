"""Fixtures for integration tests over real sockets (see tests/harness/), a leak check on
every test that uses the loop thread, and a per-test timeout guard.

Timeout guard: pytest-timeout (in the `test` extra). Unless a timeout is configured
(`--timeout`, `PYTEST_TIMEOUT`, or `timeout` in the ini file) each test without a `timeout`
marker gets DEFAULT_TEST_TIMEOUT seconds (signal method: the test fails, teardown still runs
and cancels everything left in the loop). Without the plugin, a cruder guard dumps every
thread's stack and exits the run after FALLBACK_TIMEOUT seconds, so CI never hangs.
"""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Generator, Iterator

import pytest

from tests.harness import (
    AsgiServerFactory,
    LeakBaseline,
    LoopThread,
    UpstreamFactory,
)

DEFAULT_TEST_TIMEOUT = 30.0
FALLBACK_TIMEOUT = 120.0
#: how long the leak check lets closing sockets and ending tasks settle before it fails
LEAK_SETTLE_TIMEOUT = float(os.environ.get("HARNESS_LEAK_SETTLE_TIMEOUT", "2.0"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "no_leak_check: skip the automatic task/fd/socket leak check for a loop_thread test",
    )


def _timeout_configured(config: pytest.Config) -> bool:
    return bool(
        config.getoption("timeout", None) is not None
        or os.environ.get("PYTEST_TIMEOUT")
        or config.getini("timeout")
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("timeout") or _timeout_configured(config):
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TEST_TIMEOUT))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    guard = not item.config.pluginmanager.hasplugin("timeout") and not item.config.getini(
        "faulthandler_timeout"
    )
    if guard:
        faulthandler.dump_traceback_later(FALLBACK_TIMEOUT, exit=True)
    try:
        return (yield)
    finally:
        if guard:
            faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed
    return report


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    """A fresh event loop in a daemon thread, per test.

    Function scope on purpose: a test's leftovers can never enter another test's leak
    baseline, and `stop()` cancels whatever a failed test left, so failures do not cascade.
    Starting a loop thread costs about a millisecond."""
    lt = LoopThread(name="test-loop").start()
    try:
        yield lt
    finally:
        lt.stop()


@pytest.fixture(autouse=True)
def _leak_guard(request: pytest.FixtureRequest) -> Iterator[LeakBaseline | None]:
    """Every test that uses `loop_thread` (directly or through another fixture) is checked.

    Autouse, so the baseline is taken before any other fixture of the test opens a server.
    At teardown, first the live checks, while every server still runs: no gateway request,
    upstream response or upstream connection may still be in use (stopping the servers would
    close those and hide the leak). Then the loop's registered cleanups (upstreams, ASGI
    servers) run, whatever the fixture order, and nothing beyond the baseline may remain.
    Skipped when the test body already failed (that failure is the news) or with
    `@pytest.mark.no_leak_check`."""
    if "loop_thread" not in request.fixturenames or request.node.get_closest_marker(
        "no_leak_check"
    ):
        yield None
        return
    lt: LoopThread = request.getfixturevalue("loop_thread")
    baseline = LeakBaseline(lt)
    yield baseline
    failed = request.node.stash.get(_CALL_FAILED, False)
    try:
        if not failed:  # while the servers run: stopping them would close what leaked
            baseline.check_live(LEAK_SETTLE_TIMEOUT)
    finally:
        lt.run_cleanups()
    if not failed:
        baseline.check(LEAK_SETTLE_TIMEOUT)


@pytest.fixture
def leak_check(_leak_guard: LeakBaseline | None, loop_thread: LoopThread) -> LeakBaseline:
    """The baseline the automatic check compares against (call `.check()` mid-test to assert
    that a step released everything)."""
    if _leak_guard is None:
        pytest.fail("leak_check cannot be combined with @pytest.mark.no_leak_check")
    return _leak_guard


@pytest.fixture
def scripted_upstream(loop_thread: LoopThread) -> UpstreamFactory:
    """`scripted_upstream(n) -> [ScriptedUpstream, ...]`, `scripted_upstream.one()`: started
    in the loop thread, stopped at teardown."""
    return UpstreamFactory(loop_thread)


@pytest.fixture
def asgi_server(loop_thread: LoopThread) -> AsgiServerFactory:
    """`asgi_server(app) -> RunningServer` (or `.build(make_app)`): served by uvicorn in the
    loop thread, stopped at teardown."""
    return AsgiServerFactory(loop_thread)
