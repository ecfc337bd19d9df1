"""Provider name -> adapter. The only place that knows every concrete provider."""

from __future__ import annotations

import random

from gateway.settings import BackendSettings, Timeouts
from providers.base import Provider
from providers.http import UpstreamClient
from providers.openai import OpenAIProvider
from providers.sim import SimProvider


def build_provider(
    settings: BackendSettings,
    client: UpstreamClient,
    timeouts: Timeouts,
    rng: random.Random,
) -> Provider:
    if settings.provider == "openai":
        return OpenAIProvider(settings, client, timeouts)
    if settings.provider == "sim":
        return SimProvider(settings, rng=random.Random(rng.random()))
    raise ValueError(f"unknown provider {settings.provider!r}")  # the loader refuses it first
