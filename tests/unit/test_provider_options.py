"""Per-backend upstream options: how the key is sent, static headers and query,
TLS, proxy and environment settings, and their validation. No sockets."""

from __future__ import annotations

import random

import pytest

from gateway.app import build_pools, make_http_client
from gateway.settings import BackendSettings, ConfigError, parse_settings
from gateway.settings.model import TlsSettings
from providers.openai import upstream_headers
from providers.registry import needs_own_client


def backend(**options: object) -> BackendSettings:
    return BackendSettings(name="b", base_url="https://up.example/v1", api_key="KEY",
                           **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(("provider", "auth", "header", "value"), [
    ("openai", None, "authorization", "Bearer KEY"),
    ("openai", "api-key", "api-key", "KEY"),
    ("openai", "x-api-key", "x-api-key", "KEY"),
    ("anthropic", None, "x-api-key", "KEY"),
    ("anthropic", "bearer", "authorization", "Bearer KEY"),
])
def test_auth_modes(provider: str, auth: str | None, header: str, value: str) -> None:
    headers = upstream_headers(backend(provider=provider, auth=auth))
    assert headers[header] == value
    assert not {"authorization", "api-key", "x-api-key"} - {header} & set(headers)


def test_auth_none_sends_no_key_and_static_headers_cannot_replace_it() -> None:
    assert "authorization" not in upstream_headers(backend(auth="none"))
    headers = upstream_headers(backend(headers={"Authorization": "Bearer stolen",
                                                "X-Team": "a"}))
    assert headers["authorization"] == "Bearer KEY" and headers["x-team"] == "a"


def test_settings_from_yaml_values() -> None:
    settings = parse_settings({"pools": [{"name": "p", "backends": [{
        "name": "azure", "base_url": "https://r.openai.azure.com/openai/deployments/d",
        "auth": "api-key", "query": {"api-version": "2024-10-21"},
        "headers": {"x-a": 1}, "tls": {"verify": False}, "proxy": "http://u:p@proxy:3128",
    }]}]}, {})
    (b,) = settings.pools[0].backends
    assert b.query == (("api-version", "2024-10-21"),) and b.headers == (("x-a", "1"),)
    assert b.tls == TlsSettings(verify=False) and needs_own_client(b)
    assert "u:p" not in repr(b)  # a proxy URL may carry credentials


@pytest.mark.parametrize(("entry", "message"), [
    ({"headers": {"Host": "x"}}, "set by the gateway"),
    ({"headers": {"bad name": "x"}}, "not a valid header name"),
    ({"headers": {"x-a": "line\nbreak"}}, "line breaks"),
    ({"query": ["api-version"]}, "must be a mapping"),
    ({"auth": "basic"}, "must be one of"),
    ({"tls": {"ca_file": "/no/such/bundle.pem"}}, "no such file"),
    ({"proxy": "socks5://proxy:1080"}, "http(s) URL"),
])
def test_bad_options_name_their_key(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings({"pools": [{"name": "p", "backends": [
            {"name": "b", "base_url": "https://up.example/v1", **entry}]}]}, {})
    assert any(message in error and "pools[0].backends[0]." in error
               for error in caught.value.errors), caught.value.errors


def test_default_backends_share_the_client() -> None:
    assert not needs_own_client(backend())
    assert needs_own_client(backend(trust_env=True))


@pytest.mark.parametrize("options", [{"tls": {"verify": False}}, {"trust_env": True},
                                     {"proxy": "http://proxy.example:3128"}])
async def test_a_backend_with_its_own_client_gets_the_configured_connection_bound(
        options: dict[str, object]) -> None:
    """A backend reached through its own TLS, proxy or environment settings has a client of
    its own; its bound, and its aiohttp connector's limit, are the shared client's, which the
    configuration sizes (2 x `server.max_concurrent_requests`), not a fixed smaller number
    that left streams past it waiting for a slot the server had admitted them to."""
    settings = parse_settings({"server": {"max_concurrent_requests": 1500}, "pools": [{
        "name": "p", "backends": [
            {"name": "shared", "base_url": "http://127.0.0.1:9/v1"},
            {"name": "own", "base_url": "http://127.0.0.1:9/v1", **options}]}]}, {})
    client = make_http_client(settings)
    pools = build_pools(settings, client, lambda: 0.0, random.Random(1))
    providers = pools["p"].providers
    own = providers["own"]._client  # type: ignore[attr-defined]
    try:
        assert providers["shared"]._client is client  # type: ignore[attr-defined]
        assert own is not client
        assert client.max_connections == own.max_connections == 3000
        connector = own._get_session().connector
        assert connector is not None and connector.limit == 3000
    finally:
        await own.aclose()
        await client.aclose()
