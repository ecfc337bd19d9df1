"""Provider name -> adapter. The only place that knows every concrete provider.

An adapter's module is imported the first time a pool uses it, never at start-up: the cloud
providers need libraries that only they use (botocore, google-auth), installed as the extras
`hedge-gateway[bedrock]` and `[vertex]`, and a missing one must not stop a gateway that does
not use it. A configuration that names a provider whose extra is missing is a configuration
error (`missing_extras`, read by `check-config`, `serve` and a reload) naming the extra.

A backend whose TLS, proxy or environment settings differ from the defaults gets its own
`UpstreamClient` (a client's connector and session fix them), closed with the provider; every
other backend shares the app's client.
"""

from __future__ import annotations

import importlib
import random
import ssl
from dataclasses import dataclass
from typing import Protocol

from gateway.settings import BackendSettings, Settings, Timeouts
from gateway.settings.model import TlsSettings
from gateway.tenants.stores import missing_store_extra
from providers.base import Provider
from providers.http import UpstreamClient
from providers.sim import SimProvider
from providers.tls import CaContexts


class _HttpAdapter(Protocol):
    """The constructor every adapter but the simulator has."""

    def __call__(self, settings: BackendSettings, client: UpstreamClient, timeouts: Timeouts,
                 *, owns_client: bool = ...) -> Provider: ...


@dataclass(frozen=True, slots=True)
class ProviderKind:
    """Where a provider's adapter lives, and the extra that installs its libraries (None: the
    core install has them)."""

    module: str
    adapter: str
    extra: str | None = None


#: every provider of `BackendSettings.provider`
KINDS: dict[str, ProviderKind] = {
    "sim": ProviderKind("providers.sim", "SimProvider"),
    "openai": ProviderKind("providers.openai", "OpenAIProvider"),
    "anthropic": ProviderKind("providers.anthropic", "AnthropicProvider"),
    "bedrock": ProviderKind("providers.bedrock", "BedrockProvider", extra="bedrock"),
    "vertex": ProviderKind("providers.vertex", "VertexProvider", extra="vertex"),
}


class MissingExtra(LookupError):
    """A provider's libraries are not installed: `extra` names what installs them."""

    def __init__(self, provider: str, extra: str, missing: str) -> None:
        self.provider, self.extra, self.missing = provider, extra, missing
        super().__init__(
            f"provider {provider!r} needs the extra {extra!r}, which is not installed "
            f"({missing}): pip install 'hedge-gateway[{extra}]'")


def _adapter(provider: str) -> object:
    """The adapter class of `provider`, importing its module now if no pool has yet."""
    kind = KINDS[provider]
    try:
        module = importlib.import_module(kind.module)
    except ImportError as exc:  # ModuleNotFoundError, or a library's own "needs X" ImportError
        if kind.extra is None:
            raise  # the core install is broken: not a configuration problem
        raise MissingExtra(provider, kind.extra, str(exc).splitlines()[0]) from None
    return getattr(module, kind.adapter)


def missing_extras(settings: Settings) -> list[str]:
    """One error line per backend whose provider's extra is not installed, with its key path,
    and one for a PostgreSQL `server.store` without its driver; empty when every part the
    configuration names can be built."""
    store = missing_store_extra(settings.server.store)
    errors: list[str] = [] if store is None else [store]
    for p, pool in enumerate(settings.pools):
        for b, backend in enumerate(pool.backends):
            try:
                _adapter(backend.provider)
            except MissingExtra as exc:
                errors.append(f"pools[{p}].backends[{b}].provider: {exc}")
    return errors


def needs_own_client(settings: BackendSettings) -> bool:
    return settings.tls != TlsSettings() or settings.proxy is not None or settings.trust_env


def own_client(settings: BackendSettings, contexts: CaContexts | None = None, *,
               max_connections: int) -> UpstreamClient:
    """A client with this backend's TLS, proxy and environment settings; never redirects.
    `contexts`: the app's contexts by CA bundle, shared across backends and reloads.

    `max_connections` is the shared client's bound (the app sizes it from
    `server.max_concurrent_requests`): a backend reached through its own CA or proxy carries
    as many streams as any other. A fixed smaller bound (it was 256) made the streams past it
    wait `timeouts.connect` for a slot and then fail with "pool full", while the server
    admitted them (default 512 concurrent requests)."""
    verify: ssl.SSLContext | bool = settings.tls.verify
    if settings.tls.verify and settings.tls.ca_file is not None:
        verify = (contexts.get(settings.tls.ca_file) if contexts is not None
                  else ssl.create_default_context(cafile=settings.tls.ca_file))
    return UpstreamClient(
        max_connections=max_connections,
        ssl=verify,
        proxy=settings.proxy,
        trust_env=settings.trust_env,
    )


def build_provider(
    settings: BackendSettings,
    client: UpstreamClient,
    timeouts: Timeouts,
    rng: random.Random,
    contexts: CaContexts | None = None,
) -> Provider:
    """The backend's adapter. MissingExtra when its provider's libraries are not installed
    (the loader's `missing_extras` names them first)."""
    if settings.provider == "sim":
        return SimProvider(settings, rng=random.Random(rng.random()))
    build: _HttpAdapter = _adapter(settings.provider)  # type: ignore[assignment]
    own = needs_own_client(settings)
    http = own_client(settings, contexts, max_connections=client.max_connections) if own \
        else client
    return build(settings, http, timeouts, owns_client=own)
