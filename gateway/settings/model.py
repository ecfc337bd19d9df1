"""Frozen settings: the whole configuration as plain data, and the one place its keys are written.

Each field carries, in `field(metadata=...)`, the parser of its YAML value, its one-line
description and its YAML key where that differs (see `gateway.settings.fields`). The loader,
`hedge-gateway schema` and construction in code all read these, so adding a key is adding a
field here (and a line to config/full-reference.yaml, which a test holds to this model).
Rules that span fields live in `_rules`, so an object built in code obeys them as a loaded one
does; defaults that depend on other fields live in `_complete`.

Durations are seconds as floats. Defaults are documented in docs/configuration.md. Provider keys
are kept
out of every `repr` so a settings object can be logged without leaking them. Attribute access is
plain (slots), since the request path reads these per request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import ssl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from gateway.settings import parse as cv
from gateway.settings import upstream as uv
from gateway.settings.caching import min_keyed_tokens
from gateway.settings.fields import At, Checked, items, scalar, section
from gateway.settings.tenants import TenantKeySettings, store_url

MiB = 1024 * 1024
_probability = cv.number(0, 1)


@dataclass(frozen=True, slots=True)
class DelaySettings(Checked):
    """How long the race waits for a first token before it starts a hedge."""

    mode: Literal["adaptive", "fixed"] = field(default="adaptive", metadata=scalar(
        cv.choice(("adaptive", "fixed")), "adaptive: a quantile of recent TTFT; fixed: `value`"))
    quantile: float | Literal["auto"] = field(default="auto", metadata=scalar(
        cv.auto_or_fraction(),
        "auto: follow the hedge rate the budget pays for; a number strictly "
        "between 0 and 1 pins the quantile"))
    min: float = field(default=0.050, metadata=scalar(
        cv.duration(zero=True), "lower clamp of the adaptive delay (0 allowed)"))
    max: float = field(default=5.0, metadata=scalar(
        cv.duration(), "upper clamp of the adaptive delay; min <= max"))
    initial: float = field(default=0.5, metadata=scalar(
        cv.duration(zero=True), "the delay until `min_samples` TTFTs are known (0 allowed)"))
    window: float = field(default=60.0, metadata=scalar(
        cv.duration(), "how far back TTFT samples count"))
    min_samples: int = field(default=20, metadata=scalar(
        cv.integer(1), "TTFT samples needed before the adaptive delay is used"))
    value: float = field(default=0.3, metadata=scalar(
        cv.duration(zero=True), "the delay in fixed mode (0 allowed: hedge at once)"))
    by_size: bool = field(default=True, metadata=scalar(
        cv.boolean, "learn the delay per size class of the request's uncached input "
        "(streams); false: one delay per backend"))

    def _rules(self, at: At) -> Iterator[str]:
        if self.min > self.max:
            yield f"{at('min')}: must be <= max"


@dataclass(frozen=True, slots=True)
class BudgetSettings(Checked):
    """The token bucket that caps extra attempts."""

    ratio: float = field(default=0.1, metadata=scalar(
        cv.number(0), "tokens deposited per request: extra attempts stay near this share"))
    burst: float = field(default=10.0, metadata=scalar(
        cv.number(1), "bucket size; the bucket starts full"))
    min_per_second: float = field(default=0.5, metadata=scalar(
        cv.number(0), "reserve refill per second, so quiet pools can hedge"))
    min_win_rate: float = field(default=0.15, metadata=scalar(
        _probability, "when the hedge win rate (0..1) is below this with 95 % confidence, "
        "hedges are probes only"))
    win_window: int = field(default=20, metadata=scalar(
        cv.integer(20), "how many recent hedge outcomes the win rate is computed over"))
    probe_interval: float = field(default=5.0, metadata=scalar(
        cv.duration(), "while hedges do not win: at most one hedge this often"))
    input_tokens: bool = field(default=True, metadata=scalar(
        cv.boolean, "also count input tokens: each request deposits ratio x its input "
        "tokens, each extra attempt costs its input tokens; false: attempts only"))
    burst_input_tokens: int = field(default=100_000, metadata=scalar(
        cv.integer(1), "input tokens the bucket holds (it starts full); an attempt larger "
        "than this goes only from a full bucket"))


@dataclass(frozen=True, slots=True)
class StallSettings(Checked):
    """After the first token: a stream that stalls or breaks is continued on another
    backend (`BackendSettings.continuation` says how each continues an answer)."""

    enabled: bool = field(default=True, metadata=scalar(
        cv.boolean, "false: a stream that stalls waits, one that breaks ends with an error"))
    min: float = field(default=2.0, metadata=scalar(
        cv.duration(), "the shortest stall delay: no token for this long at least"))
    max: float = field(default=30.0, metadata=scalar(
        cv.duration(), "the longest stall delay; min <= max"))
    max_continuations: int = field(default=2, metadata=scalar(
        cv.integer(0, 5), "continuations per request at most; 0: none"))

    def _rules(self, at: At) -> Iterator[str]:
        if self.min > self.max:
            yield f"{at('min')}: must be <= max"


@dataclass(frozen=True, slots=True)
class HedgingSettings(Checked):
    """When and how often a pool sends extra attempts."""

    enabled: bool = field(default=True, metadata=scalar(
        cv.boolean, "false: no delay-triggered hedges in this pool"))
    max_attempts: int = field(default=2, metadata=scalar(
        cv.integer(1, 5), "attempts per request, hedges and failure replacements together"))
    delay: DelaySettings = field(default_factory=DelaySettings, metadata=section(
        DelaySettings, "when a hedge starts"))
    budget: BudgetSettings = field(default_factory=BudgetSettings, metadata=section(
        BudgetSettings, "the token bucket that caps extra attempts"))
    skip_cold: bool = field(default=True, metadata=scalar(
        cv.boolean, "no hedge whose copy would prefill the whole input cold for longer "
        "than the primary likely still needs, and no spill off a loaded home that would "
        "prefill it cold for longer than the wait it dodges (streams)"))
    stall: StallSettings = field(default_factory=StallSettings, metadata=section(
        StallSettings, "streams that stall or break after their first token"))


@dataclass(frozen=True, slots=True)
class AffinitySettings(Checked):
    """Which backend a conversation's requests go to first: the one most likely to hold its
    prefix in its prompt cache (most of a long prompt's time to first token is prefill)."""

    enabled: bool = field(default=True, metadata=scalar(
        cv.boolean, "false: this pool spreads every request by load alone"))
    #: None until the pool fills in what its backends cache (`PoolSettings._complete`)
    min_input_tokens: int | None = field(default=None, metadata=scalar(
        cv.optional(cv.integer(0)), "shorter requests (estimated from the body size) get no "
        "key unless the client sent one: no cache would hold them, balance matters more. "
        "null: by what the pool's backends cache: 64 when one is a self-hosted engine (an "
        "openai backend whose base_url is not a hosted API's, a sim with a prefix cache), "
        "which caches any prefix; else 1024, the hosted APIs' smallest cacheable prompt"))
    load_factor: float = field(default=1.25, metadata=scalar(
        cv.number(1), "a conversation's backend takes it while its in-flight attempts are at "
        "most this many times its share of the pool's, rounded up; else it spills over"))


@dataclass(frozen=True, slots=True)
class Timeouts(Checked):
    """The request limits and deadlines, per pool."""

    connect: float = field(default=2.0, metadata=scalar(
        cv.duration(), "TCP+TLS connect to an upstream"))
    first_token: float = field(default=30.0, metadata=scalar(
        cv.duration(), "no first token by then: 504"))
    idle: float = field(default=60.0, metadata=scalar(
        cv.duration(), "longest gap between upstream events after the first token"))
    max_stream: float = field(default=600.0, metadata=scalar(cv.duration(), "longest stream"))
    stuck_client: float = field(default=30.0, metadata=scalar(
        cv.duration(), "a client that reads nothing for this long is dropped"))


@dataclass(frozen=True, slots=True)
class HealthSettings(Checked):
    """Ejection after consecutive failures, with a growing cool-down."""

    eject_after: int = field(default=5, metadata=scalar(
        cv.integer(1), "consecutive failures before a backend is ejected"))
    cooldown: float = field(default=5.0, metadata=scalar(
        cv.duration(), "first ejection length; doubles on each repeat up to max_cooldown"))
    max_cooldown: float = field(default=60.0, metadata=scalar(
        cv.duration(), "the longest ejection; cooldown <= max_cooldown"))
    max_pause: float = field(default=30.0, metadata=scalar(
        cv.duration(), "the longest a Retry-After keeps a backend out of selection"))
    panic_below: float = field(default=0.5, metadata=scalar(
        _probability, "below this share (by weight) of usable backends, a request may go to "
        "paused or ejected ones too (0: never)"))
    default_pause: float = field(default=1.0, metadata=scalar(
        cv.duration(), "the pause of a throttle that names none (a 429 without Retry-After, "
        "Bedrock's throttling); <= max_pause"))
    min_headroom: float = field(default=0.05, metadata=scalar(
        cv.number(0, 1, open_high=True), "a backend whose rate-limit headers show less than "
        "this share of its quota left is skipped while another has room (0: never)"))

    def _rules(self, at: At) -> Iterator[str]:
        if self.cooldown > self.max_cooldown:
            yield f"{at('cooldown')}: must be <= max_cooldown"
        if self.default_pause > self.max_pause:
            yield f"{at('default_pause')}: must be <= max_pause"


@dataclass(frozen=True, slots=True)
class SimProfile(Checked):
    """What a simulated backend does. Times in seconds."""

    ttft_median: float = field(default=0.15, metadata=scalar(
        cv.duration(zero=True), "time to first token: lognormal with this median"))
    ttft_sigma: float = field(default=0.25, metadata=scalar(
        cv.number(0), "sigma of the lognormal time to first token"))
    straggler_probability: float = field(default=0.03, metadata=scalar(
        _probability, "share of requests (0..1) that stall before the first token"))
    straggler_extra: float = field(default=1.5, metadata=scalar(
        cv.duration(zero=True), "how much longer a straggler stalls"))
    tokens: int = field(default=30, metadata=scalar(cv.integer(1), "tokens per response"))
    inter_token: float = field(default=0.005, metadata=scalar(
        cv.duration(zero=True), "delay between tokens"))
    usage: bool = field(default=True, metadata=scalar(cv.boolean, "send a final usage chunk"))
    fail_probability: float = field(default=0.0, metadata=scalar(
        _probability, "share of requests answered with fail_status before any byte"))
    fail_status: int = field(default=500, metadata=scalar(
        cv.integer(400, 599), "the status of a simulated failure"))
    hang_probability: float = field(default=0.0, metadata=scalar(
        _probability, "share that send headers and a role chunk, then nothing"))
    midstream_error_probability: float = field(default=0.0, metadata=scalar(
        _probability, "share that fail in-band after a few tokens"))
    stall_probability: float = field(default=0.0, metadata=scalar(
        _probability, "share of streams that stall once after their first token, at a "
        "random token"))
    stall_length: float = field(default=5.0, metadata=scalar(
        cv.duration(zero=True), "how long a mid-stream stall lasts"))
    break_probability: float = field(default=0.0, metadata=scalar(
        _probability, "share of streams that break after their first token, at a random "
        "token"))
    break_kind: str = field(default="reset", metadata=scalar(
        cv.choice(("reset", "closed", "error", "malformed")), "how a stream breaks: reset "
        "(the connection drops mid-body), closed (the body ends without its end event), "
        "error (an in-band error event; overloaded_error on Messages), malformed (half an "
        "event, then the connection ends)"))
    seed: int | None = field(default=None, metadata=scalar(
        cv.optional(cv.integer(0)), "integer >= 0 for a repeatable sequence; null: random"))
    draws: str = field(default="sequence", metadata=scalar(
        cv.choice(("sequence", "request")), "sequence: each request takes the next draws of "
        "the seeded sequence; request: a request's draws follow from the seed and its "
        "messages, so the same request meets the same luck whatever came before it (the "
        "benchmarks compare modes on equal draws)"))
    prefill_ms_per_1k: float = field(default=0.0, metadata=scalar(
        cv.number(0), "milliseconds added to the TTFT per 1,000 input tokens (about 4 bytes "
        "of text each) not in this backend's prefix cache; 0: no prefill time and no cache"))
    prefix_cache_entries: int = field(default=4096, metadata=scalar(
        cv.integer(0), "message prefixes the backend's prompt cache holds (least recently "
        "used go first)"))
    rate_limit_requests: int = field(default=0, metadata=scalar(
        cv.integer(0), "requests allowed per rate_limit_window, stated in rate-limit headers "
        "on every answer; past it, 429 with Retry-After; 0: no quota and no headers"))
    rate_limit_window: float = field(default=60.0, metadata=scalar(
        cv.duration(), "the quota's window: it starts with the first request"))


@dataclass(frozen=True, slots=True)
class TlsSettings(Checked):
    """How the gateway checks an upstream's certificate."""

    verify: bool = field(default=True, metadata=scalar(
        cv.boolean, "false: do not check the certificate (testing only)"))
    ca_file: str | None = field(default=None, metadata=scalar(
        cv.optional(cv.nonempty_text), "a PEM bundle to trust instead of the system's"))

    def _rules(self, at: At) -> Iterator[str]:
        if self.ca_file is not None and not os.path.isfile(self.ca_file):
            yield f"{at('ca_file')}: no such file"
        elif self.ca_file is not None:
            try:  # what the backend's client will do with it at start
                ssl.create_default_context(cafile=self.ca_file)
            except (ssl.SSLError, OSError, ValueError):
                yield f"{at('ca_file')}: not a readable PEM bundle of CA certificates"


@dataclass(frozen=True, slots=True)
class AwsSettings(Checked):
    """AWS credentials of a bedrock backend; without them, botocore's standard chain."""

    access_key_id: str | None = field(default=None, repr=False, metadata=scalar(
        cv.secret, "with secret_access_key; empty or null (both): the standard chain "
        "(environment, profile files, web identity). Never logged"))
    secret_access_key: str | None = field(default=None, repr=False, metadata=scalar(
        cv.secret, "the secret of access_key_id; never logged, never printed"))
    session_token: str | None = field(default=None, repr=False, metadata=scalar(
        cv.secret, "for temporary credentials; empty or null: none. Never logged"))

    def _rules(self, at: At) -> Iterator[str]:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            yield (f"{at('access_key_id')}: access_key_id and secret_access_key go together "
                   "(both empty: the standard credential chain)")
        elif self.session_token is not None and self.access_key_id is None:
            yield f"{at('session_token')}: needs access_key_id and secret_access_key"


@dataclass(frozen=True, slots=True)
class GoogleSettings(Checked):
    """Google credentials of a vertex backend; without a file, the metadata server."""

    credentials_file: str | None = field(default=None, metadata=scalar(
        cv.optional(cv.nonempty_text), "a service-account JSON key file; null: the "
        "metadata server (GCE, GKE, Cloud Run)"))

    def _rules(self, at: At) -> Iterator[str]:
        if self.credentials_file is not None and not os.path.isfile(self.credentials_file):
            yield f"{at('credentials_file')}: no such file"


@dataclass(frozen=True, slots=True)
class PriceSettings(Checked):
    """What a backend charges, in US dollars per million tokens: the spend of each request
    (its losing attempts included) is counted from these (docs/tenants.md)."""

    input: float = field(default=0.0, metadata=scalar(
        cv.number(0), "USD per million input tokens (not read from a cache)"))
    cached_input: float | None = field(default=None, metadata=scalar(
        cv.optional(cv.number(0)), "USD per million input tokens read from the upstream's "
        "prompt cache; null: the input price"))
    output: float = field(default=0.0, metadata=scalar(
        cv.number(0), "USD per million output tokens"))


#: how each provider sends `api_key` unless `auth` says otherwise (bedrock signs its requests
#: with AWS credentials, vertex sends a Google OAuth token: neither takes an api_key)
DEFAULT_AUTH = {"openai": "bearer", "anthropic": "x-api-key", "sim": "none",
                "bedrock": "none", "vertex": "none"}
#: the body's `anthropic_version` of the cloud providers, unless the backend sets its own
CLOUD_ANTHROPIC_VERSIONS = {"bedrock": "bedrock-2023-05-31", "vertex": "vertex-2023-10-16"}
#: providers that find their upstream from `region` (and `project`), not from `base_url`
CLOUD_PROVIDERS = ("bedrock", "vertex")
#: the APIs each provider speaks (what its adapter's `serves` covers; a test holds them equal)
PROVIDER_APIS: dict[str, tuple[str, ...]] = {
    "openai": ("chat", "responses", "completions", "embeddings"),
    "anthropic": ("messages",), "bedrock": ("messages",), "vertex": ("messages",),
    "sim": cv.API_NAMES,
}


@dataclass(frozen=True, slots=True)
class BackendSettings(Checked):
    """One upstream of a pool."""

    name: str = field(metadata=scalar(cv.name, "unique within the pool; same characters as "
                                     "pool names"))
    provider: Literal["openai", "anthropic", "bedrock", "vertex", "sim"] = field(
        default="openai", metadata=scalar(
            cv.choice(("openai", "anthropic", "bedrock", "vertex", "sim")),
            "openai: any OpenAI-compatible HTTP API (chat, completions, embeddings, "
            "responses); anthropic: the Messages API; bedrock, vertex: Claude's Messages on "
            "AWS Bedrock and Google Vertex AI; sim: the built-in simulator (every route)"))
    #: "" until the pool fills in its own name (`PoolSettings._complete`)
    model: str = field(default="", metadata=scalar(
        cv.nonempty_text, "the model name sent upstream; default: the pool name",
        default_shown=False))
    base_url: str | None = field(default=None, metadata=scalar(
        cv.optional(cv.http_url), "required for openai and anthropic: http(s), no user:pass@, "
        "no query; openai appends /chat/completions, anthropic /v1/messages; bedrock and "
        "vertex derive it from region", default_shown=False))
    region: str | None = field(default=None, metadata=scalar(
        cv.optional(uv.cloud_region), "bedrock and vertex (required): us-east-1, "
        "europe-west1, global (vertex)", default_shown=False))
    project: str | None = field(default=None, metadata=scalar(
        cv.optional(uv.cloud_project), "vertex (required): the Google Cloud project id",
        default_shown=False))
    aws: AwsSettings | None = field(default=None, metadata=section(
        AwsSettings, "bedrock's AWS credentials; absent: the standard chain"))
    google: GoogleSettings | None = field(default=None, metadata=section(
        GoogleSettings, "vertex's Google credentials; absent: the metadata server"))
    api_key: str | None = field(default=None, repr=False, metadata=scalar(
        cv.secret, "sent as `auth` says; empty or null: none. Never logged, never printed"))
    auth: Literal["bearer", "api-key", "x-api-key", "none"] | None = field(
        default=None, metadata=scalar(
            cv.optional(cv.choice(("bearer", "api-key", "x-api-key", "none"))),
            "how api_key is sent: bearer (openai's default), api-key (classic Azure), "
            "x-api-key (anthropic's default), none", default_shown=False))
    #: "" until `_complete` fills in the provider's own default
    anthropic_version: str = field(default="", metadata=scalar(
        uv.version, "anthropic: the anthropic-version header (default 2023-06-01); bedrock, "
        "vertex: the body's anthropic_version (default bedrock-2023-05-31, "
        "vertex-2023-10-16)", default_shown=False))
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False, metadata=scalar(
        uv.headers, "static request headers {name: value}; ${VAR} allowed; never logged"))
    query: tuple[tuple[str, str], ...] = field(default=(), repr=False, metadata=scalar(
        uv.query, "static query parameters {name: value} (classic Azure's api-version); "
        "never logged (some APIs take a key there)"))
    tls: TlsSettings = field(default_factory=TlsSettings, metadata=section(
        TlsSettings, "certificate checks of this upstream"))
    proxy: str | None = field(default=None, repr=False, metadata=scalar(
        cv.optional(uv.proxy_url), "an egress proxy URL for this upstream; null: none"))
    trust_env: bool = field(default=False, metadata=scalar(
        cv.boolean, "true: also read HTTP(S)_PROXY, NO_PROXY and SSL_CERT_FILE from the "
        "environment"))
    group: str = field(default="", metadata=scalar(
        cv.text, "label (zone, provider); hedges prefer another group"))
    weight: float = field(default=1.0, metadata=scalar(
        cv.number(0, open_low=True), "share of primaries relative to the other backends"))
    max_concurrency: int | None = field(default=None, metadata=scalar(
        cv.optional(cv.integer(1)), "attempts in flight at most; null: no cap"))
    apis: tuple[str, ...] | None = field(default=None, metadata=scalar(
        cv.optional(cv.apis), "the APIs this backend speaks, of those its provider does "
        "(chat, responses, messages, completions, embeddings); null: all its provider's. "
        "Requests in another API are translated to one it speaks (the pool's `translate`)"))
    sim: SimProfile | None = field(default=None, metadata=section(
        SimProfile, "the simulated behaviour (provider sim only)"))
    #: None until `_complete` fills in the provider's own default
    continuation: Literal["prefill", "continue_final_message", "none"] | None = field(
        default=None, metadata=scalar(
            cv.optional(cv.choice(("prefill", "continue_final_message", "none"))),
            "how this backend continues a stalled or broken answer: prefill (a final "
            "assistant message the model goes on from: anthropic, bedrock, vertex, sim), "
            "continue_final_message (that message with continue_final_message: true and "
            "add_generation_prompt: false: vLLM, SGLang), none (no continuation is sent to "
            "it: openai's default, since its base_url may be OpenAI itself; also "
            "llama-cpp-python's OpenAI server, which starts a new turn after a final "
            "assistant message instead of continuing it)",
            default_shown=False))
    price: PriceSettings | None = field(default=None, metadata=section(
        PriceSettings, "USD per million tokens (input, cached_input, output); absent: its "
        "requests are not priced"))

    #: what a validator can check of `_rules` (`hedge-gateway schema` adds it to the backend)
    json_rules: ClassVar[dict[str, object]] = {
        "if": {"properties": {"provider": {"const": "sim"}}, "required": ["provider"]},
        "then": {"not": {"anyOf": [{"required": ["base_url"]}, {"required": ["api_key"]}]}},
        "else": {
            "not": {"required": ["sim"]},
            "if": {"properties": {"provider": {"enum": list(CLOUD_PROVIDERS)}},
                   "required": ["provider"]},
            "then": {
                "required": ["region"],
                "if": {"properties": {"provider": {"const": "vertex"}}},
                "then": {"required": ["project"]},
                "else": {},
            },
            "else": {"required": ["base_url"]},
        },
    }

    def _complete(self) -> None:
        if self.provider == "sim" and self.sim is None:
            self._set("sim", SimProfile())
        if self.auth is None:
            self._set("auth", DEFAULT_AUTH[self.provider])
        if self.continuation is None:
            self._set("continuation", "none" if self.provider == "openai" else "prefill")
        if not self.anthropic_version:
            self._set("anthropic_version",
                      CLOUD_ANTHROPIC_VERSIONS.get(self.provider, "2023-06-01"))

    def min_keyed_tokens(self) -> int:
        """The shortest input (tokens) worth a conversation key on this backend, by what its
        provider caches (`gateway.settings.caching`); its pool's default threshold is the
        smallest of its backends'."""
        sim = self.sim
        caches = sim is not None and sim.prefill_ms_per_1k > 0 and sim.prefix_cache_entries > 0
        return min_keyed_tokens(self.provider, self.base_url, caches)

    def _rules(self, at: At) -> Iterator[str]:
        if self.provider in ("openai", "anthropic"):
            if self.base_url is None:
                yield f"{at('base_url')}: required"
            if self.sim is not None:
                yield f"{at('sim')}: only used by provider sim"
        elif self.provider == "sim":
            if self.base_url is not None:
                yield f"{at('base_url')}: not used by provider sim"
            if self.api_key is not None:
                yield f"{at('api_key')}: not used by provider sim"
        else:
            yield from self._cloud_rules(at)
        # the keys of one provider on another are a mistake, never silently ignored
        owners = {"region": CLOUD_PROVIDERS, "project": ("vertex",), "aws": ("bedrock",),
                  "google": ("vertex",)}
        for key, providers in owners.items():
            if getattr(self, key) is not None and self.provider not in providers:
                yield f"{at(key)}: only used by provider {' and '.join(providers)}"
        spoken = PROVIDER_APIS[self.provider]
        for api in self.apis or ():
            if api not in spoken:
                yield (f"{at('apis')}: provider {self.provider} does not speak {api} (it "
                       f"speaks {', '.join(spoken)})")

    def _cloud_rules(self, at: At) -> Iterator[str]:
        """bedrock and vertex: located by region (and project), credentials of their own."""
        if self.region is None:
            yield f"{at('region')}: required"
        if self.provider == "vertex" and self.project is None:
            yield f"{at('project')}: required"
        if self.api_key is not None:
            credentials = "aws" if self.provider == "bedrock" else "google"
            yield f"{at('api_key')}: not used by provider {self.provider} (see `{credentials}`)"
        if self.sim is not None:
            yield f"{at('sim')}: only used by provider sim"


@dataclass(frozen=True, slots=True)
class PoolSettings(Checked):
    """One model name for clients, served by a set of interchangeable backends."""

    name: str = field(metadata=scalar(cv.name, "the `model` clients send; unique. Characters "
                                     "A-Z a-z 0-9 . _ : / - ; no `..`, no leading /"))
    backends: tuple[BackendSettings, ...] = field(metadata=items(
        BackendSettings, "backend", "the upstreams; at least one, names unique in the pool"))
    timeout: float = field(default=60.0, metadata=scalar(
        cv.duration(), "the request deadline; all attempts share it"))
    timeouts: Timeouts = field(default_factory=Timeouts, metadata=section(
        Timeouts, "limits of one upstream attempt and of the client stream"))
    hedging: HedgingSettings = field(default_factory=HedgingSettings, metadata=section(
        HedgingSettings, "when and how often this pool sends extra attempts"))
    health: HealthSettings = field(default_factory=HealthSettings, metadata=section(
        HealthSettings, "ejection of failing backends"))
    affinity: AffinitySettings = field(default_factory=AffinitySettings, metadata=section(
        AffinitySettings, "keep a conversation's requests on the backend that caches it"))
    translate: bool = field(default=True, metadata=scalar(
        cv.boolean, "true: a request whose API a backend does not speak is translated to one "
        "it does (Chat Completions <-> Messages); false: only backends that speak the "
        "request's API serve it"))

    def _complete(self) -> None:
        if self.affinity.min_input_tokens is None:
            self._set("affinity", dataclasses.replace(self.affinity, min_input_tokens=min(
                backend.min_keyed_tokens() for backend in self.backends)))
        if any(not backend.model for backend in self.backends):
            self._set("backends", tuple(
                backend if backend.model else dataclasses.replace(backend, model=self.name)
                for backend in self.backends
            ))

    def _rules(self, at: At) -> Iterator[str]:
        yield from unique_names(self.backends, "backends", "backend name {!r} in this pool", at)


@dataclass(frozen=True, slots=True)
class TracingSettings(Checked):
    """OpenTelemetry traces; off unless this or the OTEL_* variables say otherwise."""

    exporter: Literal["env", "none", "console", "otlp"] = field(default="env", metadata=scalar(
        cv.choice(("env", "none", "console", "otlp")),
        "env: follow OTEL_TRACES_EXPORTER (unset: none); none: off; console; otlp (the `otlp` "
        "extra)"))
    endpoint: str | None = field(default=None, metadata=scalar(
        cv.optional(cv.http_url), "OTLP/HTTP base URL; null: OTEL_EXPORTER_OTLP_ENDPOINT or "
        "the exporter's default"))
    service_name: str | None = field(default=None, metadata=scalar(
        cv.optional(cv.nonempty_text), "service.name; null: OTEL_SERVICE_NAME or hedge-gateway"))


#: the `server` keys a reload changes in a running server: the client and ops keys, so a leaked
#: one is revoked without a restart (the others are bound at start: the socket, the limits)
RELOADED_SERVER_KEYS = ("api_keys", "ops_keys", "admin_keys")


@dataclass(frozen=True, slots=True)
class ServerSettings(Checked):
    """The listening side: address, client authentication and request limits."""

    host: str = field(default="127.0.0.1", metadata=scalar(cv.nonempty_text,
                                                          "address to listen on"))
    port: int = field(default=8080, metadata=scalar(
        cv.integer(0, 65535), "port to listen on (0: any free port)"))
    api_keys: tuple[str, ...] = field(default=(), repr=False, metadata=scalar(
        cv.keys, "keys clients must send as `Authorization: Bearer KEY` (or `x-api-key: KEY` "
        "on /v1/messages); empty: no authentication"))
    allowed_origins: tuple[str, ...] = field(default=(), metadata=scalar(
        cv.origins, "browser origins (`https://app.example.com`) whose pages may call the "
        "gateway; a request with any other `Origin` gets 403 (the gateway's own pages always "
        "may)"))
    allowed_hosts: tuple[str, ...] = field(default=(), metadata=scalar(
        cv.host_names, "host names a request's `Host` may name besides localhost, 127.0.0.1 "
        "and [::1] (against DNS rebinding); others get 403. Checked on a loopback listener "
        "always, on any other address once this is set; the probes answer any host"))
    ops_keys: tuple[str, ...] = field(default=(), repr=False, metadata=scalar(
        cv.keys, "keys for /hedge/*, /metrics and /dashboard (as Bearer); empty: open"))
    admin_keys: tuple[str, ...] = field(default=(), repr=False, metadata=scalar(
        cv.keys, "keys for /admin/keys (as Bearer): client keys made and revoked at run time; "
        "empty: no admin API"))
    store: str | None = field(default=None, metadata=scalar(
        cv.optional(store_url), "where keys made at run time and each key's usage live: "
        "sqlite:///path, or postgresql://user@host:port/db for a store shared by replicas (the "
        "`postgres` extra); null: the embedded file (docs/tenants.md), opened only when keys: "
        "or admin_keys is set"))
    store_down: str = field(default="open", metadata=scalar(
        cv.choice(("open", "closed")), "while the store cannot be read: open, the keys last "
        "read go on working and usage is kept for the store's return; closed, a request of a "
        "named key gets 503 (retry after a second) until the store answers again"))
    max_body_bytes: int = field(default=4 * MiB, metadata=scalar(
        cv.size, "larger request bodies get 413", key="max_body"))
    max_header_bytes: int = field(default=16 * 1024, metadata=scalar(
        cv.size, "larger request headers are refused", key="max_headers"))
    max_concurrent_requests: int = field(default=512, metadata=scalar(
        cv.integer(1), "logical requests in flight per process; beyond: 503"))
    max_inflight_body_bytes: int = field(default=32 * MiB, metadata=scalar(
        cv.size, "request-body bytes (as received) of the logical requests in flight per "
        "process; a request that would pass it gets 503 (the first is always admitted). A "
        "request holds about three times its body while in flight: size memory from this",
        key="max_inflight_body"))
    keepalive: float = field(default=15.0, metadata=scalar(
        cv.duration(), "interval of SSE keep-alive comments on quiet client streams"))
    shutdown_grace: float = field(default=10.0, metadata=scalar(
        cv.duration(zero=True), "on SIGTERM, how long live streams may run before a final "
        "error event"))
    body_timeout: float = field(default=30.0, metadata=scalar(
        cv.duration(), "a request whose head and body take longer to arrive gets 408"))
    max_connections: int = field(default=4096, metadata=scalar(
        cv.integer(1), "open client connections; a new one past this gets 503"))
    workers: int = field(default=1, metadata=scalar(
        cv.integer(1, 256), "processes accepting on the address, each with its own races, "
        "budget (burst / workers) and sketches; stats show the whole server"))
    response_id_secret: str | None = field(default=None, repr=False, metadata=scalar(
        cv.optional(cv.nonempty_text), "signs the Responses API ids the gateway hands out "
        "(they name the backend holding the response); replicas behind one load balancer "
        "need the same value (`${VAR}`); null: a new one each start, shared by the workers"))
    tracing: TracingSettings = field(default_factory=TracingSettings, metadata=section(
        TracingSettings, "OpenTelemetry traces of each race"))


@dataclass(frozen=True, slots=True)
class Settings(Checked):
    """The whole configuration: the server, the global hedging switch, the pools."""

    pools: tuple[PoolSettings, ...] = field(metadata=items(
        PoolSettings, "pool", "at least one; each pool is one model name for clients"))
    server: ServerSettings = field(default_factory=ServerSettings, metadata=section(
        ServerSettings, "the listening side: address, client keys, request limits"))
    #: the global hedging switch; a pool hedges only when both are on
    hedging_enabled: bool = field(default=True, metadata=scalar(
        cv.boolean, "global switch: false turns off delay-triggered hedges in every pool "
        "(failure replacements still happen)", key="hedging.enabled"))
    #: the global affinity switch; a pool keeps conversations together only when both are on
    affinity_enabled: bool = field(default=True, metadata=scalar(
        cv.boolean, "global switch: false spreads every pool's requests by load alone",
        key="affinity.enabled"))
    #: the client keys with names and rules (`gateway.tenants`); `server.api_keys` stay
    #: keys without rules
    keys: tuple[TenantKeySettings, ...] = field(default=(), metadata=items(
        TenantKeySettings, "key", "client keys with names, pools and limits (docs/tenants.md); "
        "empty: only server.api_keys", empty_ok=True))

    groups: ClassVar[dict[str, str]] = {"hedging": "options for every pool",
                                        "affinity": "conversation affinity in every pool"}

    def _complete(self) -> None:
        # the global switch is folded into each pool here, once, so the request path reads a
        # single flag and a reload carries the resolved value with the pool
        if not self.affinity_enabled and any(p.affinity.enabled for p in self.pools):
            self._set("pools", tuple(
                dataclasses.replace(p, affinity=dataclasses.replace(p.affinity, enabled=False))
                for p in self.pools
            ))

    def _rules(self, at: At) -> Iterator[str]:
        yield from unique_names(self.pools, "pools", "pool name {!r}", at)
        yield from self._key_rules(at)

    def _key_rules(self, at: At) -> Iterator[str]:
        """Key names and digests unique (a digest twice would make one key two tenants),
        none equal to a `server.api_keys` entry's, every pool named one that exists."""
        pools = {pool.name for pool in self.pools}
        plain = {hashlib.sha256(key.encode()).hexdigest() for key in self.server.api_keys}
        names: dict[str, int] = {}
        digests: dict[str, int] = {}
        for index, key in enumerate(self.keys or ()):
            path = f"keys[{index}]"
            if key.name in names:
                yield f"{at(path + '.name')}: duplicate key name {key.name!r} " \
                      f"(also {at(f'keys[{names[key.name]}]')})"
            names.setdefault(key.name, index)
            if key.key_sha256 is not None:
                if key.key_sha256 in digests:
                    yield f"{at(path + '.key_sha256')}: the same key as " \
                          f"{at(f'keys[{digests[key.key_sha256]}]')}"
                elif key.key_sha256 in plain:
                    yield f"{at(path + '.key_sha256')}: also listed in server.api_keys"
                digests.setdefault(key.key_sha256, index)
            for pool in key.pools or ():
                if pool not in pools:
                    yield f"{at(path + '.pools')}: no pool named {pool!r}"

    def pool(self, name: str) -> PoolSettings | None:
        for pool in self.pools:
            if pool.name == name:
                return pool
        return None


def unique_names(entries: Sequence[PoolSettings | BackendSettings], key: str, what: str,
                 at: At) -> Iterator[str]:
    """A problem for each entry whose name an earlier entry has. Entries without a name (they
    failed to load, and said so) are skipped."""
    seen: dict[str, str] = {}
    for index, entry in enumerate(entries):
        path = f"{key}[{index}]"
        if entry.name in seen:
            yield (f"{at(path + '.name')}: duplicate {what.format(entry.name)} "
                   f"(also {at(seen[entry.name])})")
        elif entry.name:
            seen[entry.name] = path
