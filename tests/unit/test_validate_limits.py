"""Body checks in linear time and bounded memory: hostile bodies within the size limit.

The work of the checks around the JSON parser (bytes examined, containers visited, keys read)
is counted by the validator itself, so linearity is asserted on counts, never on the clock;
memory is the `tracemalloc` peak while a body is parsed and checked.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
import tracemalloc
from collections.abc import Callable

import pytest

from gateway.errors import ForbiddenField, InvalidRequest
from gateway.wire.validate import (
    MAX_BODY_DEPTH,
    MAX_BODY_VALUES,
    check_body,
    count_values,
    parse_body,
    parse_body_counted,
    scan_work,
)

MiB = 1024 * 1024


def body_of(**fields: object) -> bytes:
    return json.dumps({"model": "m", "messages": [], **fields}).encode()


def nested(depth: int) -> bytes:
    return b'{"model": "m", "messages": [], "x": ' + b"[" * depth + b"]" * depth + b"}"


def test_nesting_up_to_the_limit_passes_and_one_more_level_is_refused() -> None:
    # the body object itself is one level, `x` holds the rest
    assert parse_body(nested(MAX_BODY_DEPTH - 1))["model"] == "m"
    for depth in (MAX_BODY_DEPTH, 200, 980, 5_000):
        with pytest.raises(InvalidRequest, match="nested too deeply"):
            parse_body(nested(depth))


def test_brackets_inside_strings_are_data_not_nesting_or_values() -> None:
    text = "[{" * 10_000 + "," * (2 * MAX_BODY_VALUES)
    body = parse_body(body_of(messages=[{"role": "user", "content": text}]))
    assert body["messages"][0]["content"] == text


def test_values_up_to_the_limit_pass_and_more_are_refused_before_parsing() -> None:
    # counted as separators plus opening brackets: an empty object counts twice
    fits = b'{"x": [' + b",".join([b"0"] * (MAX_BODY_VALUES - 10)) + b"]}"
    assert len(parse_body(fits)["x"]) == MAX_BODY_VALUES - 10
    fits = b'{"x": [' + b",".join([b"{}"] * (MAX_BODY_VALUES // 2 - 10)) + b"]}"
    assert len(parse_body(fits)["x"]) == MAX_BODY_VALUES // 2 - 10
    for item in (b"{}", b"[]", b"0", b'"a"', b'{"k": 1}'):
        too_many = b'{"x": [' + b",".join([item] * MAX_BODY_VALUES) + b"]}"
        with pytest.raises(InvalidRequest, match="too many values"):
            parse_body(too_many)


def test_four_mib_of_small_objects_is_refused_within_a_small_peak() -> None:
    raw = b"[" + b"{}," * (4 * MiB // 3) + b"{}]"
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequest):
            parse_body(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(raw)  # parsed, it would be about 25 bytes per byte


def test_a_long_key_over_a_long_list_is_scanned_in_work_linear_in_the_body() -> None:
    """A path text per element (key copied into each) made this quadratic."""
    works = []
    for n in (1_000, 4_000):
        key = "k" * (100 * n)
        body = {"model": "m", "messages": [], "metadata": {key: [[0]] * n},
                "extra_body": {key: [{"a": 1}] * n}}
        raw = json.dumps(body).encode()
        works.append(scan_work(body) / len(raw))
    assert works[1] < 1.5 * works[0]
    assert max(works) < 1.0


def test_a_refused_field_deep_in_a_long_list_is_named_by_its_path() -> None:
    body = {"model": "m", "messages": [], "extra_body": {"k" * 50: [0] * 500 + [{"url": 1}]}}
    with pytest.raises(ForbiddenField) as info:
        check_body(body, needs_prompt="messages")
    assert info.value.param == f"extra_body.{'k' * 50}[500].url"


@pytest.mark.parametrize("field", ["azure_endpoint", "AzureEndpoint", "aws_region",
                                   "AWS-Secret-Access-Key", "awsProfile", "vertex_project",
                                   "VERTEX-LOCATION", "vertexCredentials"])
def test_routing_names_refused_in_metadata_are_refused_at_the_top_and_in_extra_body(
    field: str,
) -> None:
    for body in ({field: "x"}, {"extra_body": {"a": [{field: "x"}]}}):
        with pytest.raises(ForbiddenField) as info:
            check_body({"model": "m", "messages": [], **body}, needs_prompt="messages")
        assert info.value.param is not None and info.value.param.endswith(field)


def unterminated_escaped_quotes(tail_bytes: int, unit: bytes = b'\\"') -> bytes:
    """Past the value limit in commas (so the strings are cut out and counted again), then
    one string that never ends, made of escaped quotes: every quote in it starts a string."""
    return (b'{"model": "m", "x": [' + b"0," * MAX_BODY_VALUES + b'0], "y": "'
            + unit * (tail_bytes // len(unit)))


def test_an_unterminated_string_of_escaped_quotes_is_counted_without_rescanning_it() -> None:
    """A string the scan could not end made it start again at each quote inside it and read
    to the end of the body each time: quadratic, hours of CPU for a 4 MiB body. Counting is
    linear (tens of milliseconds for 4 MiB), so the bound on process time below is not a
    measurement of speed: it is tens of times the linear figure and only the quadratic scan
    can cross it. The body doubles from 32 KiB, so such a scan fails at a size that takes
    seconds, not at the 4 MiB that would take hours."""
    tail = 32 * 1024
    while tail <= 4 * MiB:
        raw = unterminated_escaped_quotes(tail)
        start = time.process_time()
        values, _ = count_values(raw)
        spent = time.process_time() - start
        assert values > MAX_BODY_VALUES
        assert spent < 2.0, (len(raw), spent)
        tail *= 2


@pytest.mark.parametrize("where", ["top", "metadata"])
def test_a_long_key_of_many_words_is_checked_in_memory_a_few_times_its_length(
    where: str,
) -> None:
    """Each key is checked for routing names; splitting a 4 MiB key into its two million
    words held them all at once (hundreds of megabytes), where the check needs only the
    first word and the key without its separators."""
    key = "a1" * (2 * MiB - 40)
    body = {key: 0} if where == "top" else {"metadata": {key: 0}}
    raw = body_of(**body)
    tracemalloc.start()
    try:
        checked(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * len(raw), peak / len(raw)


# ---- seeded fuzz -----------------------------------------------------------------------------

Shape = Callable[[random.Random, int], bytes]


def _long_key_list(rng: random.Random, size: int) -> bytes:
    n = rng.randint(1, max(1, size // 8))
    key = "k" * max(1, size - 4 * n)
    where = rng.choice(["metadata", "extra_body"])
    return body_of(**{where: {key: [rng.choice([0, {}, [], "s", {"a": [1]}])] * n}})


def _small_objects(rng: random.Random, size: int) -> bytes:
    item = rng.choice([b"{}", b"[]", b"0", b'""', b'{"a":{}}', b"[[]]"])
    return b'{"model": "m", "x": [' + b",".join([item] * (size // (len(item) + 1))) + b"]}"


def _deep(rng: random.Random, size: int) -> bytes:
    depth = rng.randint(1, max(1, size // 2 - 40))
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    return b'{"model": "m", "metadata": ' + opener * depth + b"0" + closer * depth + b"}"


def _prose(rng: random.Random, size: int) -> bytes:
    words = ["[", "]", "{", "}", ",", '"', "\\", "word", "é", "\n"]
    text = "".join(rng.choice(words) for _ in range(size // 4))
    return body_of(messages=[{"role": "user", "content": text}])


def _random_tree(rng: random.Random, size: int) -> bytes:
    def tree(budget: int, depth: int) -> object:
        if budget < 8 or depth > 80 or rng.random() < 0.2:
            return rng.choice([0, 1.5, "s" * rng.randint(0, 20), None, True])
        parts = [tree(budget // 3, depth + 1) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.5:
            return parts
        return {f"{rng.choice(['k', 'url', 'aws', 'x'])}{i}": v for i, v in enumerate(parts)}

    return body_of(metadata=tree(size, 0), extra_body=tree(size, 0))


def _humped_key(rng: random.Random, size: int) -> bytes:
    # a word every character or two, at the top level or in `metadata`
    unit = rng.choice(["a1", "aB", "Ab1", "a_"])
    key = unit * max(1, (size - 40) // len(unit))
    return body_of(**({key: 0} if rng.random() < 0.5 else {"metadata": {key: 0}}))


def _escaped_quotes(rng: random.Random, size: int) -> bytes:
    # escaped quotes or quote-backslash pairs, the string ending there or on a lone backslash
    raw = unterminated_escaped_quotes(size, rng.choice([b'\\"', b'"\\']))
    return raw + rng.choice([b"", b"\\"])


SHAPES: dict[str, Shape] = {"long_key_list": _long_key_list, "small_objects": _small_objects,
                            "deep": _deep, "prose": _prose, "random_tree": _random_tree,
                            "escaped_quotes": _escaped_quotes, "humped_key": _humped_key}


def checked(raw: bytes) -> int:
    """The validator's work on `raw` (however it ends)."""
    try:
        body, work = parse_body_counted(raw)
    except InvalidRequest:
        return len(raw)
    with contextlib.suppress(InvalidRequest):
        check_body(body, needs_prompt=None)
    return work + scan_work(body)


@pytest.mark.parametrize("seed", range(6))
def test_fuzzed_bodies_cost_linear_work_and_bounded_memory_per_byte(seed: int) -> None:
    rng = random.Random(seed)
    for name, shape in SHAPES.items():
        for size in (200, 5_000, 100_000, 400_000):
            raw = shape(rng, size)
            tracemalloc.start()
            try:
                work = checked(raw)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert work <= 8 * len(raw) + 1000, (name, size, work / len(raw))
            assert peak <= 64 * len(raw) + 64 * 1024, (name, size, peak / len(raw))
