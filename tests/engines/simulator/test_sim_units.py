"""The simulator's pure parts: version switches, token plans, the metrics text."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from enginesim.behaviour import Behaviour, version_tuple
from enginesim.engine import Work
from enginesim.metrics import Exposition, Histogram
from enginesim.openai_chat import Answer, Dialect, count_prompt_tokens, plan
from enginesim.vllm_app import reasoning_fields


@pytest.mark.parametrize(
    ("version", "fields"),
    [
        ("0.10.2", ("reasoning_content",)),
        ("0.11.0", ("reasoning_content",)),
        ("0.11.1", ("reasoning", "reasoning_content")),
        ("0.15.1", ("reasoning", "reasoning_content")),
        ("0.16.0rc1", ("reasoning",)),
        ("0.29.0", ("reasoning",)),
    ],
)
def test_vllm_reasoning_field_by_version(version: str, fields: tuple[str, ...]) -> None:
    assert reasoning_fields(version_tuple(version)) == fields


def test_version_tuples() -> None:
    assert version_tuple("0.11.1rc2") == (0, 11, 1)
    assert version_tuple("6500") == (6500,)
    assert version_tuple("0.10.1.1") == (0, 10, 1, 1)


def test_plans_count_pieces_and_stop_at_the_limit() -> None:
    tokens, finish = plan("Hello there world", "Hmm ok", None, None)
    assert [t.text for t in tokens] == ["Hmm", " ok", "Hello", " there", " world"]
    assert finish == "stop"
    tokens, finish = plan("Hello there world", "", ("f", '{"a": 1}'), 2)
    assert ([t.kind for t in tokens], finish) == (["tool_name", "tool_args"], "length")
    assert count_prompt_tokens("") == 1
    assert count_prompt_tokens("x" * 9) == 3


async def _joined(events: AsyncIterator[str]) -> str:
    return "".join([event async for event in events])


@pytest.mark.parametrize("include_usage", [False, True])
def test_streamed_pieces_are_the_bytes_json_writes(include_usage: bool) -> None:
    """A piece's event is its answer's template filled with the piece's text: it must be
    exactly what json.dumps writes for the whole event, whatever the text holds."""
    text = 'Plain "quoted" back\\slash tab\there \u00e9 \U0001f600 </script> \\u0000 {"x": 1}'
    tokens, finish = plan(text, "", None, None)
    dialect = Dialect(
        reasoning_fields=("reasoning",),
        new_tool_call_id=lambda: "call-1",
        choice_extras={"stop_reason": None},
    )
    for kind, field in (("chat", "delta"), ("text", "text")):
        work = Work("r", 1, tokens, finish)
        work.produced, work.pending, work.ended, work.finish = (
            list(tokens),
            list(tokens),
            True,
            finish,
        )
        answer = Answer(work, "chatcmpl-r", "tiny", dialect, include_usage)
        body = asyncio.run(
            _joined(answer.chat_events() if kind == "chat" else answer.text_events())
        )
        payloads = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
        assert payloads[-1] == "[DONE]"
        events = [json.loads(payload) for payload in payloads[:-1]]
        assert [json.dumps(event) for event in events] == payloads[:-1]
        if field == "delta":
            parts = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
        else:
            parts = [e["choices"][0]["text"] for e in events if e["choices"]]
        assert "".join(parts) == text
        assert ("usage" in events[0]) is include_usage


def test_exposition_writes_prometheus_text() -> None:
    out = Exposition()
    out.counter("vllm:prompt_tokens", "Prompt tokens.", [({"model_name": "m"}, 3)])
    hist = Histogram(buckets=(1.0,))
    hist.observe(0.5)
    out.histogram("x_seconds", "X.", {}, hist)
    assert out.text().splitlines() == [
        "# HELP vllm:prompt_tokens Prompt tokens.",
        "# TYPE vllm:prompt_tokens counter",
        'vllm:prompt_tokens_total{model_name="m"} 3.0',
        "# HELP x_seconds X.",
        "# TYPE x_seconds histogram",
        'x_seconds_bucket{le="1.0"} 1.0',
        'x_seconds_bucket{le="+Inf"} 1.0',
        "x_seconds_count 1.0",
        "x_seconds_sum 0.5",
    ]


def test_behaviour_documents_refuse_unknown_keys() -> None:
    with pytest.raises(ValueError, match="tokens_per_secnd"):
        Behaviour.model_validate({"tokens_per_secnd": 3})
