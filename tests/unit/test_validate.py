"""`metadata` is free-form: only destination and credential names are refused in it,
in any case or separator; the stricter top-level and `extra_body` rules stay."""

from __future__ import annotations

import pytest

from gateway.errors import ForbiddenField, InvalidRequest
from gateway.wire.validate import check_body, is_metadata_routing_field

REFUSED = ["api_base", "base_url", "api_key", "api_version", "azure_endpoint", "baseURL",
           "API-KEY", "APIBase", "api.version", "AzureEndpoint", "aws", "aws_region",
           "AWS-SECRET-ACCESS-KEY", "awsRegion", "AWSRegion", "vertex_project", "VertexLocation",
           "VERTEX_CREDENTIALS", "vertexAI"]
PASSED = ["url", "headers", "extra_headers", "URL", "user_id", "awesome", "vertexai", "x_aws",
          "base", "key", "", "_", "123"]


@pytest.mark.parametrize("key", REFUSED)
def test_destination_and_credential_names_are_refused_in_metadata(key: str) -> None:
    assert is_metadata_routing_field(key)


@pytest.mark.parametrize("key", PASSED)
def test_other_names_pass_in_metadata(key: str) -> None:
    assert not is_metadata_routing_field(key)


def test_metadata_is_scanned_at_any_depth_and_names_the_path() -> None:
    body = {"model": "m", "messages": [], "metadata": {"a": [{"b": {"aws_region": "x"}}]}}
    with pytest.raises(ForbiddenField) as info:
        check_body(body, needs_prompt="messages")
    assert info.value.param == "metadata.a[0].b.aws_region"


def test_url_and_headers_stay_refused_at_the_top_level_and_in_extra_body() -> None:
    free = {"model": "m", "messages": [], "metadata": {"url": "u", "headers": {"h": "v"}}}
    assert check_body(free, needs_prompt="messages") == ("m", False)
    bodies: tuple[dict[str, object], ...] = ({"url": "u"}, {"extra_body": {"x": {"headers": {}}}})
    for body in bodies:
        with pytest.raises(ForbiddenField):
            check_body({"model": "m", "messages": [], **body}, needs_prompt="messages")


@pytest.mark.parametrize(("extra", "field"), [
    ({"messages": 5}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}, 5]}, "messages[1]"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": ["f"]}, "tools[0]"),
    ({"stop": 5}, "stop"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"system": {"text": "s"}}, "system"),
    ({"metadata": "u"}, "metadata"),
    ({"input": 5}, "input"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"instructions": ["s"]}, "instructions"),
    ({"reasoning": "low"}, "reasoning"),
    ({"text": "json"}, "text"),
    ({"response_format": "json"}, "response_format"),
])
def test_a_field_of_another_type_than_every_api_reads_is_refused_naming_it(
        extra: dict[str, object], field: str) -> None:
    """A value no API takes there, which a translation to another API could not read either:
    a 400 naming it before anything is sent (not a failure inside a translation mid-race)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(InvalidRequest) as caught:
        check_body(body, needs_prompt=None)
    assert caught.value.status == 400 and caught.value.param == field


def test_every_shape_the_apis_take_passes() -> None:
    """Strings or arrays where an API takes either, `null` as the field left out."""
    for extra in ({"stop": "x"}, {"stop": ["x"]}, {"stop": None}, {"system": "s"},
                  {"system": [{"type": "text", "text": "s"}]}, {"input": "hi"},
                  {"input": [1, 2]}, {"prompt": ["a"]}, {"metadata": None},
                  {"tools": [{"type": "function", "function": {"name": "f"}}]},
                  {"reasoning": {"effort": "low"}}, {"text": {"format": {"type": "text"}}},
                  {"instructions": "s"}, {"response_format": {"type": "json_object"}}):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
        assert check_body(body, needs_prompt="messages") == ("m", False)
