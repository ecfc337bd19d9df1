"""Anthropic's Messages API (`provider: anthropic`).

The wire work is the OpenAI adapter's (one `UpstreamClient` request, raw SSE batches, the same error
translation and header allowlist); what differs is where the request goes and how it
authenticates: `base_url` is what the Anthropic SDK takes (`https://api.anthropic.com`, no
`/v1`), the key goes in `x-api-key` (unless `auth` says otherwise), and `anthropic-version`
is the configured one. The client's `anthropic-beta` arrives in `UpstreamCall.extra_headers`.
"""

from __future__ import annotations

from gateway.settings import BackendSettings, Timeouts
from providers.base import UpstreamCall
from providers.http import UpstreamClient
from providers.openai import PASS_HEADERS, OpenAIProvider

#: Anthropic's own response headers worth passing on, beyond the OpenAI allowlist (which
#: holds every rate-limit header, Anthropic's included)
ANTHROPIC_PASS_HEADERS = frozenset({"request-id"}) | PASS_HEADERS


class AnthropicProvider(OpenAIProvider):
    """A backend that speaks Anthropic's Messages API."""

    serves: frozenset[str] = frozenset({"messages", "messages/count_tokens"})

    def __init__(
        self,
        settings: BackendSettings,
        client: UpstreamClient,
        timeouts: Timeouts,
        *,
        owns_client: bool = False,
    ) -> None:
        super().__init__(settings, client, timeouts, owns_client=owns_client)
        self._headers["anthropic-version"] = settings.anthropic_version
        self.pass_headers = ANTHROPIC_PASS_HEADERS

    def url(self, call: UpstreamCall) -> str:
        return f"{self._base_url}/v1/{call.path or call.endpoint}"
