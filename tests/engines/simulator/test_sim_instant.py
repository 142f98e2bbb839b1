"""The instant engine (`Behaviour.instant`) of every family: the whole answer at once, on the
lean path, in the same OpenAI wire format and behind the same per-launch key; and a paced
engine that still keeps its pace now that the tokens due together leave together."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from engines.simulator.helpers import (
    FAST,
    HELLO,
    KEY,
    Engine,
    Engines,
    Servers,
    send_and_hang_up,
    sse_events,
)
from enginesim import Faults
from support import wait_for

WORDS = 300
ANSWER = "Hello " + " ".join(f"w{i}" for i in range(WORDS - 1))
# No reasoning: llama-server parses it by default, and the counts below are the answer's.
INSTANT = FAST.model_copy(update={"instant": True, "answer": ANSWER, "reasoning": ""})
CHAT = "/v1/chat/completions"
TINY = ("--served-model-name", "tiny")


@pytest.fixture(scope="module", params=["vllm", "sglang", "llama-server"])
def instant(request: pytest.FixtureRequest, servers: Servers) -> Iterator[Engine]:
    """Each family's engine, instant, serving the name `tiny` behind the key `KEY`."""
    family: str = request.param
    name = f"instant-{family}"
    if family == "llama-server":
        server = servers.llama(name, 6500, INSTANT, "--alias", "tiny")
    elif family == "vllm":
        server = servers.python(name, "vllm", "0.17.0", INSTANT, *TINY)
    else:
        server = servers.python(name, "sglang", "0.5.10", INSTANT, *TINY, "--skip-server-warmup")
    with server as engine:
        yield engine


def _events(engine: Engine, path: str, body: dict[str, Any]) -> list[dict[str, Any] | str]:
    with httpx.stream(
        "POST", engine.base + path, json=body, headers=engine.headers, timeout=30
    ) as streamed:
        assert streamed.status_code == 200, streamed.read()
        assert streamed.headers["content-type"].startswith("text/event-stream")
        return list(sse_events(streamed.iter_lines()))


def test_a_whole_answer_in_one_body_with_its_usage(instant: Engine) -> None:
    client = instant.openai()
    answer = client.chat.completions.create(model="tiny", messages=HELLO)
    assert answer.choices[0].message.content == ANSWER
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == WORDS
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + WORDS
    cut = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3)
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == (
        "Hello w0 w1",
        "length",
    )


def test_a_stream_of_one_chunk_a_token_then_usage_and_done(instant: Engine) -> None:
    body = {
        "model": "tiny",
        "messages": HELLO,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = _events(instant, CHAT, body)
    assert events[-1] == "[DONE]"
    chunks = [event for event in events[:-1] if isinstance(event, dict)]
    assert len(chunks) == len(events) - 1
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    pieces = [delta["content"] for delta in deltas[1:] if delta.get("content")]
    assert (len(pieces), "".join(pieces)) == (WORDS, ANSWER)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [f for f in finishes if f] == ["stop"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == WORDS


def test_the_openai_sdk_reads_the_stream(instant: Engine) -> None:
    streamed = instant.openai().chat.completions.create(
        model="tiny", messages=HELLO, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == WORDS


def test_text_completions_whole_and_streamed(instant: Engine) -> None:
    client = instant.openai()
    whole = client.completions.create(model="tiny", prompt="Say hello", max_tokens=WORDS)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (ANSWER, "stop")
    body = {"model": "tiny", "prompt": "Say hello", "max_tokens": WORDS, "stream": True}
    events = _events(instant, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    texts = [e["choices"][0]["text"] for e in events[:-1] if isinstance(e, dict)]
    assert "".join(texts) == ANSWER


def test_the_key_still_guards_generation(instant: Engine) -> None:
    body = {"model": "tiny", "messages": HELLO}
    for path in (CHAT, "/v1/completions"):
        bare = httpx.post(instant.base + path, json=body, timeout=10)
        wrong = httpx.post(
            instant.base + path, json=body, headers={"Authorization": "Bearer nope"}, timeout=10
        )
        assert (bare.status_code, wrong.status_code) == (401, 401), path
    stranger = openai.OpenAI(base_url=f"{instant.base}/v1", api_key="nope", max_retries=0)
    with stranger, pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.create(model="tiny", messages=HELLO, stream=True)
    assert instant.status("/health") == 200


def test_a_refusal_is_answered_as_before(instant: Engine) -> None:
    refused = instant.post(CHAT, json={"model": "tiny", "messages": []})
    assert refused.status_code == 400
    assert "error" in refused.json() or refused.json().get("object") == "error"


def test_a_client_that_hangs_up_on_the_lean_path_ends_its_work(engines: Engines) -> None:
    """Nothing ever comes (the hang fault), so the request runs until its client goes."""
    hung = INSTANT.model_copy(update={"faults": Faults(hang=True)})
    engine = engines.start("vllm", "0.17.0", hung, "--api-key", KEY, key=KEY)
    engine.wait_status(200)
    for stream in (True, False):
        body: dict[str, object] = {"model": str(engines.model), "messages": HELLO, "stream": stream}
        sock = send_and_hang_up(engine.port, CHAT, body, KEY)
        wait_for(lambda: engine.metric("vllm:num_requests_running") == 1, 10, "it to run")
        sock.close()
        wait_for(lambda: engine.metric("vllm:num_requests_running") == 0, 10, "it to end")
    assert engine.metric("vllm:request_success_total") == 2  # both aborted


def test_a_paced_engine_keeps_its_pace(engines: Engines) -> None:
    """Tokens due together leave together, but none before its time: 300 tokens at
    1,000 a second take 0.3 s from the first to the last, never much less."""
    paced = FAST.model_copy(update={"tokens_per_second": 1000, "answer": ANSWER})
    engine = engines.start("vllm", "0.17.0", paced, "--api-key", KEY, key=KEY)
    engine.wait_status(200)
    body = {"model": str(engines.model), "messages": HELLO, "stream": True}
    arrivals: list[float] = []
    with httpx.stream(
        "POST", engine.base + CHAT, json=body, headers=engine.headers, timeout=30
    ) as streamed:
        for line in streamed.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                "content"
            ):
                arrivals.append(time.monotonic())
    assert len(arrivals) == WORDS
    assert arrivals[-1] - arrivals[0] >= 0.25
