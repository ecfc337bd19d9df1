"""Claude on AWS Bedrock and on Google Vertex AI through the gateway, over real sockets: the
Bedrock and Vertex simulators (`providers.sim.bedrock`, `providers.sim.vertex`) under uvicorn,
the gateway under its own server class, the official `anthropic` SDK as the client, unchanged.

The simulators check what the clouds check (a SigV4 signature recomputed with botocore, an
OAuth token they issued against a service account's signed JWT), so every answer here also
says the gateway signed and authenticated correctly. Tests order by causality: a simulator's
`Reply.hold` keeps one backend silent until the test opens a gate. Each test ends with the
automatic leak check.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anthropic
import google.auth.compute_engine._metadata as gce_metadata
import httpx
import pytest

from gateway.app import create_app
from gateway.settings import (
    BackendSettings,
    DelaySettings,
    HealthSettings,
    HedgingSettings,
    PoolSettings,
    ServerSettings,
    Settings,
)
from gateway.settings.model import AwsSettings, GoogleSettings
from gateway.settings.origin import ConfigOrigin
from providers.sim.bedrock import AwsKey, BedrockSimulator
from providers.sim.cloud import CallRecord, Reply, Responder
from providers.sim.vertex import ServiceAccount, VertexSimulator
from tests.harness import AsgiServerFactory, Gate, LoopThread
from tests.harness.builders import POOL
from tests.harness.limits_kit import Canary, stats_of, verbose_logs, wait_for

GATEWAY_KEY = "gateway-client-key"
REGION = "us-east-1"
PROJECT = "sim-project"
VERTEX_REGION = "europe-west1"
BEDROCK_MODEL = "anthropic.claude-sonnet-4-5-20250929-v1:0"
VERTEX_MODEL = "claude-sonnet-4-5@20250929"
KEY = AwsKey("AKIDGATEWAYTEST00001", "bedrock-secret-0123456789abcdef",
             "bedrock-session-token-0123456789")
ANSWER = "Hello from the cloud"
MESSAGES: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def account() -> ServiceAccount:
    return ServiceAccount.generate()


class Arrivals:
    """A responder shared by several simulators: the n-th request to arrive anywhere gets the
    n-th reply (the last one repeats). Which backend the balancer picks first is random, so
    tests script by arrival: "the first request to arrive anywhere is the primary"."""

    def __init__(self, *replies: Reply) -> None:
        self.replies = replies
        self.order: list[tuple[str, CallRecord]] = []
        self._lock = threading.Lock()

    def at(self, backend: str) -> Responder:
        def respond(call: CallRecord) -> Reply:
            with self._lock:
                self.order.append((backend, call))
                n = len(self.order) - 1
            return self.replies[min(n, len(self.replies) - 1)]

        return respond


def bedrock_sim(asgi_server: AsgiServerFactory, responder: Responder | None = None,
                ) -> tuple[BedrockSimulator, str]:
    sim = BedrockSimulator(region=REGION, keys=[KEY])
    if responder is not None:
        sim.responder = responder
    return sim, asgi_server(sim.app).base_url


def vertex_sim(asgi_server: AsgiServerFactory, account: ServiceAccount, tmp_path: Path,
               responder: Responder | None = None, *, token_lifetime: float = 3600.0,
               ) -> tuple[VertexSimulator, str, Path]:
    """The simulator, its root URL, and a service-account key file whose `token_uri` is it."""
    sim = VertexSimulator(project=PROJECT, region=VERTEX_REGION, service_account=account,
                          token_lifetime=token_lifetime)
    if responder is not None:
        sim.responder = responder
    root = asgi_server(sim.app).base_url
    sim.bind(root)
    key_file = tmp_path / "service-account.json"
    key_file.write_text(json.dumps(account.key_file(sim.token_uri)))
    return sim, root, key_file


def bedrock(name: str, url: str, *, key: AwsKey | None = KEY, weight: float = 1.0,
            ) -> BackendSettings:
    aws = None if key is None else AwsSettings(
        access_key_id=key.access_key_id, secret_access_key=key.secret_access_key,
        session_token=key.session_token)
    return BackendSettings(name=name, provider="bedrock", region=REGION, base_url=url,
                           model=BEDROCK_MODEL, aws=aws, group=name, weight=weight)


def vertex(name: str, url: str, key_file: Path | None) -> BackendSettings:
    google = None if key_file is None else GoogleSettings(credentials_file=str(key_file))
    return BackendSettings(name=name, provider="vertex", project=PROJECT,
                           region=VERTEX_REGION, base_url=url, model=VERTEX_MODEL,
                           google=google, group=name)


def pool(backends: Sequence[BackendSettings], *, name: str = POOL,
         delay: float = 5.0) -> PoolSettings:
    return PoolSettings(name=name, backends=tuple(backends), timeout=15.0,
                        hedging=HedgingSettings(delay=DelaySettings(mode="fixed", value=delay)))


def settings_for(*pools: PoolSettings) -> Settings:
    return Settings(pools=pools, server=ServerSettings(api_keys=(GATEWAY_KEY,)))


def serve(asgi_server: AsgiServerFactory, settings: Settings) -> str:
    """The gateway under uvicorn; its root URL (what the Anthropic SDK takes as base_url)."""
    return asgi_server(create_app(settings, seed=3)).base_url


def claude(root: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=root, api_key=GATEWAY_KEY, max_retries=0,
                               timeout=20.0)


def streamed(client: anthropic.Anthropic, model: str = POOL) -> tuple[str, dict[str, str]]:
    """The streamed answer's text and response headers."""
    with client.messages.with_streaming_response.create(
        model=model, max_tokens=16, messages=MESSAGES, stream=True,
        extra_headers={"anthropic-beta": "fine-grained-tool-streaming-2025-05-14"},
    ) as response:
        headers = dict(response.headers)
        text = "".join(
            event.delta.text for event in response.parse()
            if event.type == "content_block_delta" and event.delta.type == "text_delta")
    return text, headers


def whole(client: anthropic.Anthropic, model: str = POOL) -> str:
    message = client.messages.create(model=model, max_tokens=16, messages=MESSAGES)
    block = message.content[0]
    assert block.type == "text"
    return block.text


def backend_stats(root: str, name: str) -> dict[str, Any]:
    stats: dict[str, Any] = stats_of(root)["pools"][POOL]["backends"][name]
    return stats


def recorded(root: str, requests: int) -> None:
    """Wait until `requests` requests are in the stats (a request is recorded a moment after
    its client read the answer)."""
    assert wait_for(lambda: stats_of(root)["pools"][POOL]["lifetime"]["requests"] >= requests)


# --- each provider on its own --------------------------------------------------------------------


def test_bedrock_streams_and_answers_through_the_anthropic_sdk(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory
) -> None:
    sim, url = bedrock_sim(asgi_server)
    gateway = serve(asgi_server, settings_for(pool([bedrock("bedrock", url)])))
    with claude(gateway) as client:
        text, headers = streamed(client)
        assert whole(client) == ANSWER
        with client.messages.stream(model=POOL, max_tokens=16, messages=MESSAGES) as stream:
            final = stream.get_final_message()
    assert text == ANSWER and headers["x-hedge-backend"] == "bedrock"
    assert final.usage.output_tokens == 2 and final.stop_reason == "end_turn"
    assert sim.refused == []  # every signature verified
    first, second, third = sim.calls
    assert first.path == f"/model/{BEDROCK_MODEL}/invoke-with-response-stream"
    assert second.path == f"/model/{BEDROCK_MODEL}/invoke"
    assert first.model == second.model == BEDROCK_MODEL
    for call in (first, second, third):
        assert "model" not in call.body and "stream" not in call.body
        assert call.body["anthropic_version"] == "bedrock-2023-05-31"
        assert call.body["max_tokens"] == 16
        assert call.credential == KEY.access_key_id
        assert call.headers["x-amz-security-token"] == KEY.session_token
    assert first.body["anthropic_beta"] == ["fine-grained-tool-streaming-2025-05-14"]
    assert first.completed and third.completed


def test_bedrock_credentials_from_the_standard_chain(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """No `aws` keys: botocore's chain finds them in the environment (and never looks for
    an instance role: that would leave the machine)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", KEY.secret_access_key)
    monkeypatch.setenv("AWS_SESSION_TOKEN", KEY.session_token or "")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    sim, url = bedrock_sim(asgi_server)
    gateway = serve(asgi_server, settings_for(pool([bedrock("bedrock", url, key=None)])))
    with claude(gateway) as client:
        assert streamed(client)[0] == ANSWER
    assert sim.refused == [] and [c.credential for c in sim.calls] == [KEY.access_key_id]


# --- chain credentials that expire ----------------------------------------------------------------

#: a `credential_process` (botocore runs it as the standard chain's process provider): each run
#: issues the next numbered key, valid for `lifetime` seconds, and appends it to a log the
#: simulator reads as the keys it accepts
ISSUE_KEY = """
import datetime, fcntl, json, sys
log, lifetime = sys.argv[1], float(sys.argv[2])
with open(log, "a+") as file:
    fcntl.flock(file, fcntl.LOCK_EX)
    file.seek(0)
    n = sum(1 for _ in file) + 1
    expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=lifetime)
    key = {"AccessKeyId": f"AKIDPROCESS{n:09d}", "SecretAccessKey": f"process-secret-{n:04d}",
           "SessionToken": f"process-token-{n:04d}", "Expiration": expires.isoformat()}
    file.write(json.dumps(key) + "\\n")
print(json.dumps({"Version": 1, **key}))
"""


class IssuedKeys(Mapping[str, AwsKey]):
    """The keys the credential process issued so far, each until its expiry, as the
    simulator's accepted keys; a key numbered `refused_up_to` or lower counts as expired
    already (revoked, or a clock that disagrees)."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.refused_up_to = 0

    def issued(self) -> list[AwsKey]:
        if not self.log.exists():
            return []
        keys = []
        for n, line in enumerate(self.log.read_text().splitlines(), start=1):
            entry = json.loads(line)
            expires = datetime.datetime.fromisoformat(entry["Expiration"])
            if n <= self.refused_up_to:
                expires = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)
            keys.append(AwsKey(entry["AccessKeyId"], entry["SecretAccessKey"],
                               entry["SessionToken"], expires))
        return keys

    def __getitem__(self, access_key_id: str) -> AwsKey:
        for key in self.issued():
            if key.access_key_id == access_key_id:
                return key
        raise KeyError(access_key_id)

    def __iter__(self) -> Iterator[str]:
        return iter([key.access_key_id for key in self.issued()])

    def __len__(self) -> int:
        return len(self.issued())

    def all_expired(self) -> bool:
        now = datetime.datetime.now(datetime.UTC)
        return all(key.expires is not None and key.expires <= now for key in self.issued())


def process_chain(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, lifetime: float,
                  ) -> IssuedKeys:
    """botocore's standard chain with nothing but a `credential_process` in the config file
    (no environment keys, no instance metadata: nothing leaves the machine)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_ROLE_ARN", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    script, log = tmp_path / "issue_key.py", tmp_path / "issued.jsonl"
    script.write_text(ISSUE_KEY)
    config = tmp_path / "aws-config"
    config.write_text(f"[default]\ncredential_process = {sys.executable} {script} {log} "
                      f"{lifetime}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    return IssuedKeys(log)


def test_chain_credentials_that_expired_while_idle_are_never_signed_with(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Keys from a credential process that live 2 s: after an idle gap past the expiry of
    every key issued so far, the next request is signed with a key issued after that, and
    Bedrock (which refuses expired keys) answers it."""
    issued = process_chain(monkeypatch, tmp_path, lifetime=2.0)
    sim = BedrockSimulator(region=REGION, keys=issued)
    url = asgi_server(sim.app).base_url
    gateway = serve(asgi_server, settings_for(pool([bedrock("bedrock", url, key=None)])))
    with claude(gateway) as client:
        assert whole(client) == ANSWER
        assert wait_for(issued.all_expired, timeout=20.0)  # idle: no request meanwhile
        before_gap = {key.access_key_id for key in issued.issued()}
        assert whole(client) == ANSWER
    assert sim.refused == []
    first, second = sim.calls
    assert first.credential in before_gap and second.credential not in before_gap


def test_an_expired_token_answer_rereads_the_chain_and_resends_once(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Keys valid for an hour, but Bedrock calls the first one expired (revoked, or its clock
    ahead): the request is resent once with a key read anew from the chain, and answered. When
    Bedrock refuses that one too, the request fails after that one resend."""
    issued = process_chain(monkeypatch, tmp_path, lifetime=3600.0)
    issued.refused_up_to = 1
    sim = BedrockSimulator(region=REGION, keys=issued)
    url = asgi_server(sim.app).base_url
    gateway = serve(asgi_server, settings_for(pool([bedrock("bedrock", url, key=None)])))
    with claude(gateway) as client:
        assert whole(client) == ANSWER
        assert sim.refused == ["ExpiredTokenException"]
        (call,) = sim.calls
        assert call.credential == issued.issued()[-1].access_key_id != "AKIDPROCESS000000001"
        issued.refused_up_to = 10**6  # every key, past and future
        with pytest.raises(anthropic.APIStatusError):
            whole(client)
    assert sim.refused == ["ExpiredTokenException"] * 3  # one more, and its one resend
    assert len(sim.calls) == 1


def cloud_pools(b_url: str, v_url: str, key_file: Path, weight: float) -> Settings:
    """Pool `b` of one Bedrock backend and pool `v` of one Vertex backend, both at `weight`
    (a reload that changes it rebuilds both providers)."""
    return settings_for(
        pool([bedrock("bedrock", b_url, key=None, weight=weight)], name="b"),
        pool([dataclasses.replace(vertex("vertex", v_url, key_file), weight=weight)],
             name="v"))


def test_a_reload_that_rebuilds_cloud_backends_keeps_their_credentials(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, account: ServiceAccount,
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """A reload that changes a Bedrock and a Vertex backend (their weights) rebuilds their
    providers, but not where their credentials come from: the new providers sign with the
    credentials already fetched, and nothing is fetched again, before or after a request."""
    issued = process_chain(monkeypatch, tmp_path, lifetime=3600.0)
    b_sim = BedrockSimulator(region=REGION, keys=issued)
    b_url = asgi_server(b_sim.app).base_url
    v_sim, v_url, key_file = vertex_sim(asgi_server, account, tmp_path)

    app = create_app(cloud_pools(b_url, v_url, key_file, 1.0), seed=3)
    gateway = asgi_server(app).base_url
    live = app.state.live
    with claude(gateway) as client:
        assert whole(client, model="b") == ANSWER and whole(client, model="v") == ANSWER
        keys, grants = len(issued), list(v_sim.token_grants)
        backends = (("b", "bedrock"), ("v", "vertex"))
        before = [live.current.pools[p].providers[n] for p, n in backends]
        changed = cloud_pools(b_url, v_url, key_file, 2.0)
        loop_thread.call(functools.partial(
            app.state.reloader.apply, changed, ConfigOrigin.embedded(changed, now=0.0)))
        after = [live.current.pools[p].providers[n] for p, n in backends]
        assert all(new is not old for new, old in zip(after, before, strict=True))  # rebuilt
        assert whole(client, model="b") == ANSWER and whole(client, model="v") == ANSWER
    assert len(issued) == keys == 1 and v_sim.token_grants == grants == ["jwt"]
    assert b_sim.refused == [] and v_sim.refused == []
    assert len({call.credential for call in b_sim.calls}) == 1


def test_a_reload_refused_half_way_leaves_the_running_providers_their_credentials(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, account: ServiceAccount,
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """A rebuilt cloud backend takes its predecessor's credentials only once every pool of
    the reload is built: when a later backend fails to build, the reload is refused and the
    running providers keep their credentials (and close them at shutdown) as before."""
    import random

    from gateway import app as composition
    from providers.http import UpstreamClient
    from providers.registry import build_provider as built

    issued = process_chain(monkeypatch, tmp_path, lifetime=3600.0)
    b_url = asgi_server(BedrockSimulator(region=REGION, keys=issued).app).base_url
    _, v_url, key_file = vertex_sim(asgi_server, account, tmp_path)

    app = create_app(cloud_pools(b_url, v_url, key_file, 1.0), seed=3)
    running = app.state.live.current.pools

    def failing(settings: BackendSettings, *args: object, **kwargs: object) -> object:
        if settings.name == "vertex":  # built after the bedrock pool's rebuilt provider
            raise ValueError("this backend cannot be built")
        return built(settings, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(composition, "build_provider", failing)
    with pytest.raises(ValueError, match="cannot be built"):
        composition.build_pools(cloud_pools(b_url, v_url, key_file, 2.0),
                                UpstreamClient(max_connections=1), lambda: 0.0,
                                random.Random(1), previous=running)
    assert running["b"].providers["bedrock"]._owns_credentials
    assert running["v"].providers["vertex"]._owns_credentials


def test_vertex_streams_and_answers_with_a_service_account(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, account: ServiceAccount,
    tmp_path: Path,
) -> None:
    sim, url, key_file = vertex_sim(asgi_server, account, tmp_path)
    gateway = serve(asgi_server, settings_for(pool([vertex("vertex", url, key_file)])))
    with claude(gateway) as client:
        text, headers = streamed(client)
        assert whole(client) == ANSWER
    assert text == ANSWER and headers["x-hedge-backend"] == "vertex"
    assert sim.refused == []  # the JWT assertion and then the token were accepted
    assert sim.token_grants == ["jwt"]  # one token serves both requests
    first, second = sim.calls
    root = (f"/v1/projects/{PROJECT}/locations/{VERTEX_REGION}/publishers/anthropic/models/"
            f"{VERTEX_MODEL}")
    assert first.path == root + ":streamRawPredict" and second.path == root + ":rawPredict"
    assert first.body["stream"] is True and "stream" not in second.body
    for call in (first, second):
        assert "model" not in call.body
        assert call.body["anthropic_version"] == "vertex-2023-10-16"
        assert call.credential in sim.tokens
    assert first.headers["anthropic-beta"] == "fine-grained-tool-streaming-2025-05-14"


def test_vertex_tokens_from_the_metadata_server(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, account: ServiceAccount,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No key file: the token comes from the metadata server (here the simulator's; google-auth
    reads its address once, at import, so the test points that at loopback)."""
    sim, url, _ = vertex_sim(asgi_server, account, tmp_path)
    monkeypatch.setattr(gce_metadata, "_GCE_METADATA_HOST", url.removeprefix("http://"))
    gateway = serve(asgi_server, settings_for(pool([vertex("vertex", url, None)])))
    with claude(gateway) as client:
        assert whole(client) == ANSWER
    assert sim.token_grants == ["metadata"] and sim.refused == []


def test_a_vertex_token_is_refreshed_ahead_of_expiry_off_the_request_path(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, account: ServiceAccount,
    tmp_path: Path,
) -> None:
    """Tokens that live 4 s: the second is fetched with no request under way, before the first
    expired, and the next request uses it without fetching anything itself."""
    sim, url, key_file = vertex_sim(asgi_server, account, tmp_path, token_lifetime=4.0)
    gateway = serve(asgi_server, settings_for(pool([vertex("vertex", url, key_file)])))
    with claude(gateway) as client:
        assert whole(client) == ANSWER
        assert len(sim.token_grants) == 1
        first_token = sim.calls[0].credential
        assert wait_for(lambda: len(sim.token_grants) == 2, timeout=10.0)
        assert len(sim.calls) == 1  # refreshed while nothing asked for it
        assert whole(client) == ANSWER
    assert len(sim.token_grants) == 2  # the request did not fetch a token
    second_token = sim.calls[1].credential
    assert second_token != first_token and sim.tokens[first_token] > 0
    assert sim.refused == []


# --- one pool over both ---------------------------------------------------------------------------


def test_a_hedge_wins_across_providers(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, account: ServiceAccount,
    tmp_path: Path,
) -> None:
    """Whichever backend gets the primary sends its stream's head at once and then nothing
    until the test says so; the hedge goes to the other provider, wins, and the primary's
    stream is closed while it is still held."""
    held = Gate()
    arrivals = Arrivals(Reply(hold=held.wait), Reply())
    b_sim, b_url = bedrock_sim(asgi_server, arrivals.at("bedrock"))
    v_sim, v_url, key_file = vertex_sim(asgi_server, account, tmp_path, arrivals.at("vertex"))
    gateway = serve(asgi_server, settings_for(pool(
        [bedrock("bedrock", b_url), vertex("vertex", v_url, key_file)], delay=0.2)))
    try:
        with claude(gateway) as client:
            text, headers = streamed(client)
        assert text == ANSWER
        (primary_backend, primary), (hedge_backend, hedge) = arrivals.order
        assert {primary_backend, hedge_backend} == {"bedrock", "vertex"}
        assert headers["x-hedge-backend"] == hedge_backend
        assert hedge.completed and hedge.arrived > primary.arrived
        assert primary.texts_sent == 0
        assert wait_for(lambda: primary.closed_early)  # cancelled, not left to hang
        assert not held.is_open
    finally:
        held.open()
    recorded(gateway, 1)
    assert backend_stats(gateway, hedge_backend)["lifetime"]["hedges_won"] == 1
    assert b_sim.refused == [] and v_sim.refused == []


# --- throttling -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("throttle", "code"),
    [
        (Reply(status=429, error_type="ThrottlingException"), "rate_limited"),
        (Reply(fail_after=0, stream_exception="throttlingException"), "rate_limited"),
        (Reply(fail_after=0, stream_exception="modelStreamErrorException"), "error_event"),
    ],
    ids=["status-429", "throttling-frame", "model-stream-error-frame"],
)
def test_a_refused_first_attempt_fails_over(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, throttle: Reply, code: str
) -> None:
    """The first attempt is throttled (by status, or by an exception frame inside its 200
    stream) or its model stream fails before any token: the other backend answers at once,
    and a throttled backend is paused."""
    arrivals = Arrivals(throttle, Reply())
    sim, url = bedrock_sim(asgi_server, arrivals.at("bedrock"))
    names = ("east", "west")
    gateway = serve(asgi_server, settings_for(pool([bedrock(n, url) for n in names])))
    with claude(gateway) as client:
        assert streamed(client)[0] == ANSWER
    assert len(sim.calls) == 2 and sim.refused == []
    recorded(gateway, 1)
    by_backend = {name: backend_stats(gateway, name) for name in names}
    (failed,) = [n for n, s in by_backend.items() if s["lifetime"]["failed"] == 1]
    (served,) = [n for n in names if n != failed]
    assert by_backend[failed]["lifetime"]["failures"] == {code: 1}
    assert by_backend[served]["lifetime"]["failovers"] == 1
    assert by_backend[served]["lifetime"]["won"] == 1
    if code == "rate_limited":
        assert by_backend[failed]["state"] == "paused"
        assert 0 < by_backend[failed]["seconds_left"] <= 1.0


def test_every_attempt_throttled_is_a_429_with_retry_after(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, account: ServiceAccount,
    tmp_path: Path,
) -> None:
    """Bedrock throttles (no Retry-After), Vertex answers 429 RESOURCE_EXHAUSTED (none
    either): the client gets a 429 that says when to come back, and no `x-should-retry:
    false`, so an SDK with retries waits and tries again."""
    b_sim, b_url = bedrock_sim(
        asgi_server, lambda call: Reply(status=429, error_type="ThrottlingException"))
    v_sim, v_url, key_file = vertex_sim(
        asgi_server, account, tmp_path, lambda call: Reply(status=429))
    gateway = serve(asgi_server, settings_for(pool(
        [bedrock("bedrock", b_url), vertex("vertex", v_url, key_file)])))
    with claude(gateway) as client, pytest.raises(anthropic.RateLimitError) as caught:
        whole(client)
    response = caught.value.response
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.headers["retry-after-ms"] == "1000"
    assert "x-should-retry" not in response.headers
    assert caught.value.body == {"type": "error", "error": {
        "type": "rate_limit_error", "message": caught.value.body["error"]["message"]}}  # type: ignore[index]
    assert len(b_sim.calls) == len(v_sim.calls) == 1


def test_a_throttled_bedrock_backend_is_paused_for_the_pools_default_pause(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory
) -> None:
    """Bedrock's throttling names no pause: `health.default_pause` (here 7 s, not the 1 s
    default) is how long the backend is left out, and the client's Retry-After."""
    sim, url = bedrock_sim(
        asgi_server, lambda call: Reply(status=429, error_type="ThrottlingException"))
    throttled = dataclasses.replace(pool([bedrock("bedrock", url)]),
                                    health=HealthSettings(default_pause=7.0))
    gateway = serve(asgi_server, settings_for(throttled))
    with claude(gateway) as client, pytest.raises(anthropic.RateLimitError) as caught:
        streamed(client)
    response = caught.value.response
    assert response.status_code == 429
    assert (response.headers["retry-after"], response.headers["retry-after-ms"]) == ("7", "7000")
    assert "x-should-retry" not in response.headers
    recorded(gateway, 1)
    state = backend_stats(gateway, "bedrock")
    assert state["state"] == "paused" and 1.0 < state["seconds_left"] <= 7.0
    assert state["lifetime"]["failures"] == {"rate_limited": 1}
    assert len(sim.calls) == 1


def test_a_model_stream_error_after_the_first_token_reaches_the_client(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory
) -> None:
    sim, url = bedrock_sim(asgi_server, lambda call: Reply(fail_after=1))
    gateway = serve(asgi_server, settings_for(pool([bedrock("bedrock", url)])))
    seen: list[str] = []
    with claude(gateway) as client, pytest.raises(anthropic.APIStatusError) as caught, \
            client.messages.stream(model=POOL, max_tokens=16, messages=MESSAGES) as stream:
        for text in stream.text_stream:
            seen.append(text)
    assert seen == ["Hello"]  # the token before the failure, then the error event
    assert "modelStreamErrorException" in str(caught.value.body)
    assert sim.calls[0].texts_sent == 1


# --- a rejection only one provider makes ----------------------------------------------------------

#: what Bedrock answers to an `anthropic-beta` flag it does not know (Anthropic's API takes it)
INVALID_BETA = Reply(status=400, error_type="ValidationException",
                     error_message="invalid beta flag")


def rejects_betas(call: CallRecord) -> Reply:
    return INVALID_BETA if "anthropic_beta" in call.body else Reply()


def test_a_bedrock_validation_error_fails_over_and_ejects_bedrock(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, account: ServiceAccount,
    tmp_path: Path,
) -> None:
    """Bedrock refuses a beta flag that the pool's Vertex backend serves: each request whose
    primary is Bedrock fails over to Vertex and is answered; each such rejection counts as
    Bedrock's failure (`rejected_served`), and after `eject_after` of them Bedrock is out."""
    b_sim, b_url = bedrock_sim(asgi_server, rejects_betas)
    v_sim, v_url, key_file = vertex_sim(asgi_server, account, tmp_path)
    mixed = dataclasses.replace(pool([bedrock("bedrock", b_url), vertex("vertex", v_url,
                                                                         key_file)]),
                                health=HealthSettings(eject_after=2))
    gateway = serve(asgi_server, settings_for(mixed))
    with claude(gateway) as client:
        for sent in range(1, 41):  # which backend is primary is the balancer's draw
            text, headers = streamed(client)
            assert (text, headers["x-hedge-backend"]) == (ANSWER, "vertex")
            recorded(gateway, sent)
            if backend_stats(gateway, "bedrock")["state"] == "ejected":
                break
    state = backend_stats(gateway, "bedrock")
    assert state["state"] == "ejected"
    assert state["lifetime"]["failures"] == {"rejected_served": len(b_sim.calls)} \
        and len(b_sim.calls) == 2
    assert all(c.body["anthropic_beta"] == ["fine-grained-tool-streaming-2025-05-14"]
               for c in b_sim.calls)
    assert len(v_sim.calls) == sent
    with claude(gateway) as client:  # ejected: Vertex serves at once
        assert streamed(client)[1]["x-hedge-attempts"] == "1"
    assert len(b_sim.calls) == 2


def test_a_rejection_by_every_provider_reaches_the_client_with_its_explanation(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, account: ServiceAccount,
    tmp_path: Path,
) -> None:
    """Both providers reject the body: the client gets the first rejection with that
    upstream's own words, and neither backend is counted as failing (the request was at
    fault). A pool of one provider asks only one of its backends."""
    b_sim, b_url = bedrock_sim(asgi_server, lambda call: INVALID_BETA)
    v_sim, v_url, key_file = vertex_sim(asgi_server, account, tmp_path, lambda call: Reply(
        status=400, error_message="anthropic-beta: unknown flag"))
    gateway = serve(asgi_server, settings_for(
        pool([bedrock("bedrock", b_url), vertex("vertex", v_url, key_file)]),
        pool([bedrock("east", b_url), bedrock("west", b_url)], name="bedrock-only")))
    with claude(gateway) as client, pytest.raises(anthropic.BadRequestError) as caught:
        streamed(client)
    first = "bedrock" if b_sim.calls[0].arrived < v_sim.calls[0].arrived else "vertex"
    words = {"bedrock": "invalid beta flag", "vertex": "anthropic-beta: unknown flag"}[first]
    assert caught.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": f"{words} (backend {first})"}}
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert len(b_sim.calls) == len(v_sim.calls) == 1
    recorded(gateway, 1)
    for name in ("bedrock", "vertex"):
        assert backend_stats(gateway, name)["lifetime"]["failures"] == {"request_rejected": 1}
        assert backend_stats(gateway, name)["state"] == "ok"
    with claude(gateway) as client, pytest.raises(anthropic.BadRequestError) as caught:
        streamed(client, model="bedrock-only")
    message = caught.value.body["error"]["message"]  # type: ignore[index]
    assert message in ("invalid beta flag (backend east)", "invalid beta flag (backend west)")
    assert len(b_sim.calls) == 2  # one more: the other Bedrock backend was not asked


# --- secrets --------------------------------------------------------------------------------------


def test_no_credential_reaches_an_answer_a_log_or_the_stats(
    loop_thread: LoopThread, asgi_server: AsgiServerFactory, account: ServiceAccount,
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A pool whose Bedrock backend signs with a wrong secret (refused, fail over to Vertex),
    and a pool with only that backend (a 502): with the SDKs' own loggers at DEBUG, neither the
    AWS secret, the session token, the access key id, Google's tokens nor the private key
    shows in an answer, a header, a log line, `/hedge/stats` or `/metrics`."""
    verbose_logs(caplog)
    for name in ("botocore", "google", "urllib3"):
        caplog.set_level("DEBUG", logger=name)
    wrong = AwsKey(KEY.access_key_id, "a-wrong-secret-0123456789", KEY.session_token)
    b_sim, b_url = bedrock_sim(asgi_server)
    v_sim, v_url, key_file = vertex_sim(asgi_server, account, tmp_path)
    gateway = serve(asgi_server, settings_for(
        pool([bedrock("bedrock", b_url, key=wrong, weight=1000.0),
              vertex("vertex", v_url, key_file)]),
        pool([bedrock("bedrock", b_url, key=wrong)], name="bedrock-only"),
    ))
    answers: list[str] = []
    with claude(gateway) as client:
        for _ in range(2):
            with client.messages.with_streaming_response.create(
                    model=POOL, max_tokens=16, messages=MESSAGES, stream=True) as response:
                answers.append(json.dumps(dict(response.headers)) + response.read().decode())
        answers.append(client.messages.with_raw_response.create(
            model=POOL, max_tokens=16, messages=MESSAGES).http_response.text)
        with pytest.raises(anthropic.APIStatusError) as caught:
            whole(client, model="bedrock-only")
    failed = caught.value.response
    assert failed.status_code == 502
    answers.append(json.dumps(dict(failed.headers)) + failed.text)
    assert "InvalidSignatureException" in b_sim.refused  # the wrong secret was tried
    assert len(v_sim.calls) == 3
    recorded(gateway, 3)
    secrets = [KEY.secret_access_key, wrong.secret_access_key, KEY.session_token or "",
               KEY.access_key_id, *v_sim.tokens,
               account.private_key_pem.splitlines()[1]]
    Canary(*secrets).assert_absent_everywhere(gateway, caplog, *answers)
    dashboard = httpx.get(gateway + "/hedge/stats?window=all", timeout=5.0).text
    Canary(*secrets).assert_absent("stats (all windows)", dashboard)
