"""Hostile requests: the kinds of body a tester found to answer 500 on the inference API (some
after taking a place they kept), a hypothesis strategy of JSON written to break a parser, and
requests schemathesis draws from an API's OpenAPI document. Each kind of body must be a 400
invalid_request naming what is wrong, before admission; nothing may be a 5xx."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode

# The model every hostile body asks for: a ready deployment where the test has one.
MODEL = "m"
HI = '[{"role": "user", "content": "hi"}]'


def chat(fields: str) -> bytes:
    """A chat body for MODEL, with `fields` (JSON text) after its messages."""
    return f'{{"model": "{MODEL}", "messages": {HI}, {fields}}}'.encode()


# name -> (body, what the 400's message says).
KINDS: dict[str, tuple[bytes, str]] = {
    "not-utf8": (chat('"user": "cafe"').replace(b"cafe", b"caf\xe9"), "not UTF-8"),
    "latin1-prompt": (b'{"model": "m", "prompt": "\xff\xfe"}', "not UTF-8"),
    "lone-surrogate": (chat('"user": "\\ud800"'), "user: text holds a lone surrogate"),
    "lone-surrogate-key": (chat('"\\udfff": 1'), "the body: a key holds a lone surrogate"),
    "nested-1000": (chat('"x": ' + "[" * 1000 + "]" * 1000), "nested deeper than 64"),
    "nested-65": (chat('"x": ' + "[" * 65 + "]" * 65), "x" + "[0]" * 63 + ": nested deeper"),
    "nan": (chat('"temperature": NaN'), "temperature: NaN is not JSON"),
    "infinity": (chat('"top_p": Infinity'), "top_p: Infinity is not JSON"),
    "minus-infinity": (chat('"seed": -Infinity'), "seed: -Infinity is not JSON"),
    "float-overflow": (chat('"temperature": 1e999'), "temperature: 1e999 is beyond a 64-bit"),
    "integer-5000-digits": (chat('"seed": ' + "9" * 5000), "seed: an integer of 5000 digits"),
    "stream-options-list": (chat('"stream_options": [null, null]'), "stream_options: should be"),
    "stream-options-string": (chat('"stream_options": "usage"'), "stream_options: should be"),
    "stream-options-bool": (chat('"stream_options": true'), "stream_options: should be"),
    "stream-options-int": (chat('"stream_options": 1'), "stream_options: should be"),
    "include-usage-string": (
        chat('"stream": true, "stream_options": {"include_usage": "yes"}'),
        "stream_options.include_usage: Input should be a valid boolean",
    ),
    "stream-string": (chat('"stream": "true"'), "stream: Input should be a valid boolean"),
    "messages-object": (
        f'{{"model": "{MODEL}", "messages": {{"role": "user"}}}}'.encode(),
        "messages: should be a JSON array",
    ),
    "model-number": (b'{"model": 7, "messages": []}', "model: Input should be a valid string"),
    "not-an-object": (b"[1, 2]", "the body is a JSON array"),
    "not-json": (b'{"model": "m",', "the body is not JSON"),
    "empty": (b"", "the body is not JSON"),
}

# The kinds of a wrong field of a chat request; every other kind is refused by any route.
CHAT_FIELDS = frozenset(
    {
        *("stream-options-list", "stream-options-string", "stream-options-bool"),
        *("stream-options-int", "include-usage-string", "messages-object"),
    }
)

# Scalars as JSON text, from the plain to what no strict parser lets through.
_SCALARS = st.one_of(
    st.sampled_from(["null", "true", "false", "0", "-0", "1.5e-7", '""', '"hi"']),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e400"]),
    st.sampled_from(['"\\ud800"', '"\\udfff"', '"a\\ud83d"', '"\\ud83d\\ude00"', '"\\u0000"']),
    st.integers().map(str),
    st.integers(min_value=90, max_value=5000).map(lambda digits: "9" * digits),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(max_size=8).map(json.dumps),
)


def _array(items: list[str]) -> str:
    return "[" + ", ".join(items) + "]"


def _object(pairs: dict[str, str]) -> str:
    return "{" + ", ".join(f"{json.dumps(key)}: {value}" for key, value in pairs.items()) + "}"


# Any JSON value as text (or what looks like one), nested at random, sometimes far too deep.
VALUES = st.one_of(
    st.recursive(
        _SCALARS,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4).map(_array),
            st.dictionaries(st.text(max_size=6), inner, max_size=4).map(_object),
        ),
        max_leaves=12,
    ),
    st.integers(min_value=1, max_value=1500).map(lambda depth: "[" * depth + "]" * depth),
)
# The fields the router reads or rewrites, one any engine reads, and one nobody knows.
_FIELDS = st.sampled_from(
    [
        *("model", "messages", "prompt", "input", "stream", "stream_options", "include_usage"),
        *("n", "max_tokens", "x"),
    ]
)


def _with(field: str, value: str) -> bytes:
    """A body for any route (messages, prompt and input) whose `field` holds `value`."""
    if field == "include_usage":
        field, value = "stream_options", f'{{"include_usage": {value}}}'
    fields = f'"messages": {HI}, "prompt": "hi", "input": "hi", "{field}": {value}'
    return f'{{"model": "{MODEL}", {fields}}}'.encode()


# Whole bodies: a hostile value in one field, a hostile value as the body, a known kind,
# arbitrary bytes, or a good body cut short.
BODIES = st.one_of(
    st.builds(_with, _FIELDS, VALUES),
    VALUES.map(str.encode),
    st.sampled_from([body for body, _ in KINDS.values()]),
    st.binary(max_size=64),
    st.integers(min_value=0, max_value=60).map(lambda end: chat('"stream": false')[:end]),
)


def fuzzing(examples: int) -> settings:
    """Bounded runs (a fuzz file takes well under a minute) that save nothing, each example
    on the test's one app."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def openapi_cases(document: dict[str, Any]) -> st.SearchStrategy[Case[Any]]:
    """Requests for every operation of an OpenAPI document: valid ones, and ones breaking it."""
    schema = schemathesis.openapi.from_dict(document)
    return st.one_of(
        [
            schema[path][method].as_strategy(generation_mode=mode)
            for path, methods in document["paths"].items()
            for method in methods
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        ]
    )


async def send(http: httpx.AsyncClient, case: Case[Any], auth: dict[str, str]) -> httpx.Response:
    """`case` as schemathesis would send it, through `http`, with `auth`."""
    sent = case.as_transport_kwargs(base_url=str(http.base_url), headers=auth)
    if sent.get("files"):  # a multipart form, encoded as schemathesis's own client would
        prepared = requests.PreparedRequest()
        prepared.prepare_headers(None)
        prepared.prepare_body(sent.get("data"), sent["files"])
        headers = {k: v for k, v in sent["headers"].items() if k.lower() != "content-type"}
        headers["Content-Type"] = prepared.headers["Content-Type"]
        assert isinstance(prepared.body, bytes)
        return await http.request(
            sent["method"], sent["url"], headers=headers, content=prepared.body
        )
    return await http.request(
        sent["method"],
        sent["url"],
        headers=sent["headers"],
        params=sent.get("params"),
        json=sent.get("json"),
        content=sent.get("data"),
    )


def assert_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    logged = [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert logged == [], "a hostile request is no failure of ours"
