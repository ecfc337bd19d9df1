"""The race's attempt and the relay hold no default of one API: the route's `WireProtocol`
is a required argument, so a caller that forgets it fails at once instead of getting chat's
rules for a Messages or Responses stream."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from gateway.hedge.attempt import open_until_first_token, open_whole_response
from gateway.hedge.relay import relay


@pytest.mark.parametrize("function", [open_until_first_token, open_whole_response, relay])
def test_the_protocol_is_a_required_argument(function: Callable[..., Any]) -> None:
    parameters = inspect.signature(function).parameters
    assert "protocol" in parameters
    assert parameters["protocol"].default is inspect.Parameter.empty
    # no other parameter stands in for one API's rules with a default of its own
    defaults = {name for name, p in parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert not defaults & {"classify", "answered", "classify_body", "encoder", "error_event"}
