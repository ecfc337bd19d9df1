"""What a reload leaves behind, over real sockets: the gateway under its own server class, a
scripted upstream, reloads applied on the gateway's loop as SIGHUP applies them.

A reload that changes a backend (its key rotated, as an hourly `${TOKEN}` does) retires the
provider built for it. The requests that started on it still hold it, so it cannot be closed
at the swap; it must be closed once they end, or a gateway reloaded every hour keeps them
all. Tests order by causality: a held stream keeps its provider in use until the test opens
its gate.
"""

from __future__ import annotations

import dataclasses
import functools

import httpx

from gateway.hedge.generation import Live
from gateway.settings import Settings
from gateway.settings.origin import ConfigOrigin
from tests.harness import Gate, LoopThread, UpstreamFactory, stream_script
from tests.harness.builders import POOL, gateway_settings
from tests.harness.limits_kit import GatewayFactory, data_lines, holding, wait_for

RELOADS = 30


def keyed(settings: Settings, key: str) -> Settings:
    """`settings` with the pool's backend key replaced (the backend is rebuilt)."""
    (pool,) = settings.pools
    backends = tuple(dataclasses.replace(b, api_key=key) for b in pool.backends)
    return dataclasses.replace(settings, pools=(dataclasses.replace(pool, backends=backends),))


def test_retired_providers_are_closed_once_the_requests_holding_them_end(
    loop_thread: LoopThread, scripted_upstream: UpstreamFactory
) -> None:
    gate = Gate()

    upstream = scripted_upstream.one(responder=holding(gate, stream_script(["ok"])))
    settings = gateway_settings([upstream.base_url], api_key="key-0", hedging=False)
    gateway = GatewayFactory(loop_thread)(settings)
    live: Live = gateway.app.state.live
    reloader = gateway.app.state.reloader
    (first,) = live.current.pools[POOL].providers.values()
    body = {"model": POOL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.Client(base_url=gateway.v1, timeout=10.0) as http:
        with http.stream("POST", "/chat/completions", json={**body, "user": "held"}) as held:
            lines = held.iter_lines()
            data_lines(lines, "first")  # the stream runs on the first provider
            for n in range(1, RELOADS + 1):
                new = keyed(settings, f"key-{n}")
                loop_thread.call(functools.partial(
                    reloader.apply, new, ConfigOrigin.embedded(new, now=0.0)))
            # every provider retired since is closed; the one the stream holds is kept
            assert wait_for(lambda: live.retired == [first], timeout=10.0)
            gate.open()
            assert "second" in data_lines(lines, "[DONE]")[0]
        assert wait_for(lambda: live.retired == [] and live.draining == [], timeout=10.0)
        with http.stream("POST", "/chat/completions", json=body) as after:
            assert "ok" in "".join(data_lines(after.iter_lines(), "[DONE]"))
    (current,) = live.current.pools[POOL].providers.values()
    assert current is not first and len(upstream.requests) == 2
