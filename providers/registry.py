"""Provider name -> adapter. The only place that knows every concrete provider.

A backend whose TLS, proxy or environment settings differ from the defaults gets its own
`UpstreamClient` (a client's connector and session fix them), closed with the provider; every
other backend shares the app's client.
"""

from __future__ import annotations

import random
import ssl

from gateway.settings import BackendSettings, Timeouts
from gateway.settings.model import TlsSettings
from providers.anthropic import AnthropicProvider
from providers.base import Provider
from providers.bedrock import BedrockProvider
from providers.http import UpstreamClient
from providers.openai import OpenAIProvider
from providers.sim import SimProvider
from providers.tls import CaContexts
from providers.vertex import VertexProvider

#: connection bound of a backend's own client (the shared one is sized by the app)
OWN_MAX_CONNECTIONS = 256


def needs_own_client(settings: BackendSettings) -> bool:
    return settings.tls != TlsSettings() or settings.proxy is not None or settings.trust_env


def own_client(settings: BackendSettings, contexts: CaContexts | None = None) -> UpstreamClient:
    """A client with this backend's TLS, proxy and environment settings; never redirects.
    `contexts`: the app's contexts by CA bundle, shared across backends and reloads."""
    verify: ssl.SSLContext | bool = settings.tls.verify
    if settings.tls.verify and settings.tls.ca_file is not None:
        verify = (contexts.get(settings.tls.ca_file) if contexts is not None
                  else ssl.create_default_context(cafile=settings.tls.ca_file))
    return UpstreamClient(
        max_connections=OWN_MAX_CONNECTIONS,
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
    if settings.provider == "sim":
        return SimProvider(settings, rng=random.Random(rng.random()))
    own = needs_own_client(settings)
    http = own_client(settings, contexts) if own else client
    if settings.provider == "openai":
        return OpenAIProvider(settings, http, timeouts, owns_client=own)
    if settings.provider == "anthropic":
        return AnthropicProvider(settings, http, timeouts, owns_client=own)
    if settings.provider == "bedrock":
        return BedrockProvider(settings, http, timeouts, owns_client=own)
    if settings.provider == "vertex":
        return VertexProvider(settings, http, timeouts, owns_client=own)
    raise ValueError(f"unknown provider {settings.provider!r}")  # the loader refuses it first
