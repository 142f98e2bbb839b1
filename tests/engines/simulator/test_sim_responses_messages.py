"""The Responses API and Anthropic's Messages API on the simulated engines, driven by the real
`openai` and `anthropic` SDKs: answers, streams, tool calls, kept state, versions that lack
the routes, and a client's hang-up aborting the engine's work."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from clientapis import streamed_whole
from engines.simulator.helpers import (
    KEY,
    REASONS_AND_CALLS,
    SLOW,
    Engine,
    Engines,
    Servers,
    parse_metric,
    send_and_hang_up,
)
from enginesim import DisconnectLag, Faults
from enginesim.openai_chat import CHARS_PER_TOKEN
from support import wait_for

VLLM = "0.17.0"
SGLANG = "0.5.16"
LLAMA = 8000
SERVED = REASONS_AND_CALLS.model_copy(update={"tokens_per_second": 200})
ANSWER = SERVED.answer
REASONING = SERVED.reasoning
WEATHER: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
ANTHROPIC_WEATHER: list[Any] = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
HI: list[Any] = [{"role": "user", "content": "Say hello to me"}]
VLLM_FLAGS = (
    "--host",
    "127.0.0.1",
    "--served-model-name",
    "tiny",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--reasoning-parser",
    "qwen3",
)
SGLANG_FLAGS = (
    "--served-model-name",
    "tiny",
    "--tool-call-parser",
    "qwen25",
    "--reasoning-parser",
    "qwen3",
    "--skip-server-warmup",
)


def tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def words(text: str) -> int:
    return len(text.split())


def sse_pairs(text: str) -> list[tuple[str | None, str]]:
    """(event, data) of each SSE message in a body."""
    pairs: list[tuple[str | None, str]] = []
    for block in text.strip().split("\n\n"):
        event, data = None, ""
        for line in block.splitlines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
        pairs.append((event, data))
    return pairs


def claude(engine: Engine) -> anthropic.Anthropic:
    """The Anthropic SDK as CapyCTL's router reaches an engine: the key as a Bearer token."""
    return anthropic.Anthropic(
        base_url=engine.base,
        api_key=KEY,
        default_headers={"Authorization": f"Bearer {KEY}"},
        max_retries=0,
    )


def raw_stream(engine: Engine, path: str, body: dict[str, Any]) -> str:
    reply = engine.post(path, json={**body, "stream": True})
    assert reply.status_code == 200, reply.text
    return reply.text


@pytest.fixture(scope="module")
def vllm(servers: Servers) -> Iterator[Engine]:
    """vLLM with tool and reasoning parsers, keeping responses (its store on)."""
    env = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    with servers.python("vllm-apis", "vllm", VLLM, SERVED, *VLLM_FLAGS, env=env) as engine:
        yield engine


@pytest.fixture(scope="module")
def sglang(servers: Servers) -> Iterator[Engine]:
    with servers.python("sglang-apis", "sglang", SGLANG, SERVED, *SGLANG_FLAGS) as engine:
        yield engine


@pytest.fixture(scope="module")
def llama(servers: Servers) -> Iterator[Engine]:
    extra = ("-np", "2", "--alias", "tiny", "--reasoning-format", "deepseek")
    with servers.llama("llama-apis", LLAMA, SERVED, *extra) as engine:
        yield engine


# Responses: vLLM -------------------------------------------------------------------------


def test_vllm_response_whole(vllm: Engine) -> None:
    answer = vllm.openai().responses.create(
        model="tiny", input="Say hello", instructions="Be brief"
    )
    assert answer.id.startswith("resp_")
    assert (answer.object, answer.status, answer.model) == ("response", "completed", "tiny")
    assert [item.type for item in answer.output] == ["reasoning", "message"]
    assert answer.output_text == ANSWER
    message = answer.output[1]
    assert message.type == "message"
    assert message.id.startswith("msg_")
    assert (message.role, message.status) == ("assistant", "completed")
    assert answer.usage is not None
    assert answer.usage.input_tokens == tokens("Be briefSay hello")
    assert answer.usage.output_tokens == words(REASONING) + words(ANSWER)
    assert answer.usage.output_tokens_details.reasoning_tokens == words(REASONING)
    assert answer.usage.input_tokens_details.cached_tokens == 0
    assert (answer.parallel_tool_calls, answer.tool_choice, answer.temperature) == (
        True,
        "auto",
        1.0,
    )


def test_vllm_response_tool_call_whole_and_streamed(vllm: Engine) -> None:
    client = vllm.openai()
    answer = client.responses.create(model="tiny", input="Weather in Paris?", tools=WEATHER)
    call = answer.output[-1]
    assert call.type == "function_call"
    assert (call.name, json.loads(call.arguments), call.status) == (
        "get_weather",
        {"city": "Paris"},
        "completed",
    )
    assert call.call_id.startswith("chatcmpl-tool-")
    events = list(
        client.responses.create(model="tiny", input="Weather?", tools=WEATHER, stream=True)
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.output[-1].type == "function_call"


def test_vllm_response_streamed_as_vllm_writes_it(vllm: Engine) -> None:
    text = raw_stream(vllm, "/v1/responses", {"model": "tiny", "input": "Say hello"})
    pairs = sse_pairs(text)
    assert all(event is not None for event, _ in pairs)  # every message names its event
    assert "[DONE]" not in text
    datas = [json.loads(data) for _, data in pairs]
    assert [d["type"] for d in datas] == [event for event, _ in pairs]
    kinds = [d["type"] for d in datas]
    deltas = [d["delta"] for d in datas if d["type"] == "response.output_text.delta"]
    assert "".join(deltas) == ANSWER
    assert len(deltas) == words(ANSWER)  # one per token
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    completed = datas[-1]["response"]
    assert completed["status"] == "completed"
    assert completed["usage"]["output_tokens"] == words(REASONING) + words(ANSWER)


def test_vllm_previous_response_continues_with_the_store(vllm: Engine) -> None:
    client = vllm.openai()
    first = client.responses.create(model="tiny", input="My name is Ada.")
    second = client.responses.create(
        model="tiny", input="What is my name?", previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None
    assert second.usage.input_tokens == tokens("My name is Ada." + ANSWER + "What is my name?")
    kept = vllm.get(f"/v1/responses/{first.id}")
    assert (kept.status_code, kept.json()["output"][1]["content"][0]["text"]) == (200, ANSWER)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="tiny", input="Hi", previous_response_id="resp_nope")
    assert missing.value.body == {
        "message": "Response with id 'resp_nope' not found.",
        "type": "invalid_request_error",
        "param": None,
        "code": 404,
    }


def test_vllm_without_store_knows_no_response(engines: Engines) -> None:
    engine = engines.start("vllm", VLLM, SERVED, "--host", "127.0.0.1")  # no parsers, no store
    engine.wait_status(200)
    client = engine.openai()
    first = client.responses.create(input="Hello", tools=WEATHER)
    assert [item.type for item in first.output] == ["message"]  # "auto" needs a parser
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="Again", previous_response_id=first.id)
    assert engine.get(f"/v1/responses/{first.id}").status_code == 404


# Messages: vLLM --------------------------------------------------------------------------


def test_vllm_message_whole_and_tool_use(vllm: Engine) -> None:
    client = claude(vllm)
    message = client.messages.create(model="tiny", max_tokens=200, messages=HI, system="Be kind")
    assert message.id.startswith("chatcmpl-")
    assert (message.type, message.role, message.model) == ("message", "assistant", "tiny")
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[1].type == "text"
    assert message.content[1].text == ANSWER
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens == tokens("Be kindSay hello to me")
    assert message.usage.output_tokens == words(REASONING) + words(ANSWER)
    called = client.messages.create(
        model="tiny", max_tokens=200, messages=HI, tools=ANTHROPIC_WEATHER
    )
    use = called.content[-1]
    assert use.type == "tool_use"
    assert (use.name, use.input, called.stop_reason) == (
        "get_weather",
        {"city": "Paris"},
        "tool_use",
    )
    short = client.messages.create(model="tiny", max_tokens=2, messages=HI)
    assert short.stop_reason == "max_tokens"


def test_vllm_message_streamed(vllm: Engine) -> None:
    with claude(vllm).messages.stream(model="tiny", max_tokens=200, messages=HI) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == ANSWER
    assert final.stop_reason == "end_turn"
    assert [block.type for block in final.content] == ["thinking", "text"]
    raw = raw_stream(vllm, "/v1/messages", {"model": "tiny", "max_tokens": 200, "messages": HI})
    pairs = sse_pairs(raw)
    assert pairs[-1] == (None, "[DONE]")  # vLLM ends its message stream as chat's
    events = [event for event, _ in pairs[:-1]]
    assert events[0] == "message_start"
    assert events[-2:] == ["message_delta", "message_stop"]
    assert "ping" not in events


def test_vllm_message_tool_use_streamed(vllm: Engine) -> None:
    raw = raw_stream(
        vllm,
        "/v1/messages",
        {"model": "tiny", "max_tokens": 200, "messages": HI, "tools": ANTHROPIC_WEATHER},
    )
    datas = [json.loads(data) for event, data in sse_pairs(raw) if event is not None]
    starts = [d["content_block"] for d in datas if d["type"] == "content_block_start"]
    assert starts[-1]["type"] == "tool_use"
    assert (starts[-1]["name"], starts[-1]["input"]) == ("get_weather", {})
    partial = [
        d["delta"]["partial_json"]
        for d in datas
        if d["type"] == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    ]
    assert json.loads("".join(partial)) == {"city": "Paris"}
    assert datas[-2]["delta"] == {"stop_reason": "tool_use"}


def test_vllm_message_refusals_and_key(vllm: Engine) -> None:
    missing = vllm.post("/v1/messages", json={"model": "tiny", "messages": HI})
    assert missing.status_code == 400
    assert missing.json()["error"]["code"] == 400  # vLLM's own envelope: FastAPI validation
    with pytest.raises(anthropic.NotFoundError) as unknown:
        claude(vllm).messages.create(model="other", max_tokens=10, messages=HI)
    assert unknown.value.body == {
        "type": "error",
        "error": {"type": "NotFoundError", "message": "The model `other` does not exist."},
    }
    anthropic_key_only = httpx.post(
        f"{vllm.base}/v1/messages",
        headers={"x-api-key": KEY},
        json={"model": "tiny", "max_tokens": 10, "messages": HI},
    )
    assert (anthropic_key_only.status_code, anthropic_key_only.json()) == (
        401,
        {"error": "Unauthorized"},
    )


def test_vllm_counts_tokens_from_0_17(vllm: Engine, engines: Engines) -> None:
    counted = claude(vllm).messages.count_tokens(model="tiny", messages=HI, system="Be kind")
    assert counted.input_tokens == tokens("Be kindSay hello to me")
    older = engines.start("vllm", "0.16.0", SERVED, "--host", "127.0.0.1")
    older.wait_status(200)
    assert (
        older.post(
            "/v1/messages", json={"model": older_model(older), "max_tokens": 5, "messages": HI}
        ).status_code
        == 200
    )
    refused = older.post("/v1/messages/count_tokens", json={"messages": HI})
    assert (refused.status_code, refused.json()) == (404, {"detail": "Not Found"})


def older_model(engine: Engine) -> str:
    return str(engine.get("/v1/models").json()["data"][0]["id"])


def test_vllm_before_0_11_1(engines: Engines) -> None:
    engine = engines.start("vllm", "0.11.0", SERVED, "--host", "127.0.0.1")
    engine.wait_status(200)
    absent = engine.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HI})
    assert (absent.status_code, absent.json()) == (404, {"detail": "Not Found"})
    refused = engine.post("/v1/responses", json={"input": "Hi", "tools": WEATHER})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "Tool use is not supported in Responses API without Harmony None"
    )
    assert engine.post("/v1/responses", json={"input": "Hi"}).json()["status"] == "completed"


# Hang-ups --------------------------------------------------------------------------------


def test_hang_ups_abort_the_work(engines: Engines) -> None:
    """A stream of either API, and a whole answer, stop their work when the client goes."""
    engine = engines.start("vllm", VLLM, SLOW, "--host", "127.0.0.1")
    engine.wait_status(200)
    running, name = "vllm:num_requests_running", older_model(engine)
    asks: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/responses", {"input": "Go on"}, "response.output_text.delta"),
        ("/v1/messages", {"model": name, "max_tokens": 100, "messages": HI}, "content_block_delta"),
    ]
    for path, body, first in asks:
        ask = {**body, "stream": True}
        with httpx.stream("POST", engine.base + path, json=ask, timeout=30) as streamed:
            lines = streamed.iter_lines()  # held: dropping it would close the stream at once
            next(line for line in lines if line == f"event: {first}")
            assert engine.metric(running) == 1
        wait_for(lambda: engine.metric(running) == 0, 5, f"the hung-up {path} stream to be aborted")
    for path, body, _ in asks:
        sock = send_and_hang_up(engine.port, path, body, None)
        wait_for(lambda: engine.metric(running) == 1, 5, f"the whole {path} answer to run")
        sock.close()
        wait_for(lambda: engine.metric(running) == 0, 5, f"the hung-up {path} answer to be aborted")
    aborts = [
        line
        for line in engine.get("/metrics").text.splitlines()
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line
    ]
    assert float(aborts[0].rpartition(" ")[2]) == 4


# SGLang ----------------------------------------------------------------------------------


def test_sglang_response_whole_tool_and_state(sglang: Engine) -> None:
    client = sglang.openai()
    first = client.responses.create(model="tiny", input="My name is Ada.")
    assert first.output_text == ANSWER
    assert first.usage is not None
    assert first.usage.input_tokens == tokens("My name is Ada.")
    second = client.responses.create(model="tiny", input="Name?", previous_response_id=first.id)
    assert second.usage is not None
    assert second.usage.input_tokens == tokens("My name is Ada." + ANSWER + "Name?")
    called = client.responses.create(model="tiny", input="Weather?", tools=WEATHER)
    assert called.output[-1].type == "function_call"
    invalid = sglang.post("/v1/responses", json={"input": "Hi", "previous_response_id": "nope"})
    assert (invalid.status_code, invalid.json()["error"]["param"]) == (400, "response_id")
    unknown = sglang.post("/v1/responses", json={"input": "Hi", "previous_response_id": "resp_x"})
    assert unknown.status_code == 404
    assert unknown.json() == {
        "error": {
            "message": "Response with id 'resp_x' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }
    unkept = client.responses.create(model="tiny", input="Forget me", store=False)
    assert sglang.get(f"/v1/responses/{unkept.id}").status_code == 404


def test_sglang_streams_no_item_events(sglang: Engine) -> None:
    events = list(sglang.openai().responses.create(model="tiny", input="Hello", stream=True))
    assert streamed_whole(events).output_text == ANSWER


def test_sglang_messages(sglang: Engine) -> None:
    client = claude(sglang)
    message = client.messages.create(
        model="tiny", max_tokens=200, messages=HI, tools=ANTHROPIC_WEATHER
    )
    assert message.id.startswith("msg_")
    assert message.content[-1].type == "tool_use"
    assert message.usage.cache_read_input_tokens == 0
    with client.messages.stream(model="tiny", max_tokens=200, messages=HI) as stream:
        assert "".join(stream.text_stream) == ANSWER
    raw = raw_stream(sglang, "/v1/messages", {"model": "tiny", "max_tokens": 200, "messages": HI})
    assert "[DONE]" not in raw
    assert client.messages.count_tokens(model="tiny", messages=HI).input_tokens == tokens(
        HI[0]["content"]
    )
    missing = sglang.post("/v1/messages", json={"model": "tiny", "messages": HI})
    assert (missing.status_code, missing.json()["object"]) == (400, "error")  # flat


def test_sglang_stream_hang_up_aborts_after_its_lag(engines: Engines) -> None:
    lag = Faults(disconnect_abort_lag=DisconnectLag(non_stream=0.2, stream=0.2))
    engine = engines.start(
        "sglang", SGLANG, SLOW.model_copy(update={"faults": lag}), "--enable-metrics"
    )
    engine.wait_status(200)
    body = {"model": "m", "max_tokens": 100, "messages": HI, "stream": True}
    with httpx.stream("POST", engine.base + "/v1/messages", json=body, timeout=30) as streamed:
        lines = streamed.iter_lines()
        next(line for line in lines if line == "event: content_block_delta")
        assert engine.metric("sglang:num_running_reqs") == 1
    wait_for(lambda: engine.metric("sglang:num_running_reqs") == 0, 5, "the stream to be aborted")
    assert engine.metric("sglang:num_aborted_requests_total") == 1


def test_sglang_before_its_versions(engines: Engines) -> None:
    engine = engines.start("sglang", "0.5.8", SERVED, "--skip-server-warmup")
    engine.wait_status(200)
    absent = engine.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HI})
    assert (absent.status_code, absent.json()) == (404, {"detail": "Not Found"})
    usage = engine.post("/v1/responses", json={"input": "Hi"}).json()["usage"]
    assert usage["prompt_tokens"] == 0  # its usage before the Responses fixes: zeros, chat's shape


# llama.cpp -------------------------------------------------------------------------------


def test_llama_response_and_stateless_refusal(llama: Engine) -> None:
    client = llama.openai()
    answer = client.responses.create(model="tiny", input="Say hello")
    assert answer.id.startswith("resp_")
    assert answer.output_text == ANSWER
    assert [item.type for item in answer.output] == ["reasoning", "message"]
    called = client.responses.create(input="Weather?", tools=WEATHER)
    call = called.output[-1]
    assert call.type == "function_call"
    assert call.call_id.startswith("fc_")
    events = list(client.responses.create(input="Hello", stream=True))
    assert events[-1].type == "response.completed"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="Again", previous_response_id=answer.id)
    assert refused.value.body == {
        "code": 400,
        "message": "llama.cpp does not support 'previous_response_id'.",
        "type": "invalid_request_error",
    }


def test_llama_messages(llama: Engine) -> None:
    client = anthropic.Anthropic(base_url=llama.base, api_key=KEY, max_retries=0)  # x-api-key
    message = client.messages.create(
        model="tiny", max_tokens=200, messages=HI, tools=ANTHROPIC_WEATHER
    )
    assert message.content[-1].type == "tool_use"
    assert message.stop_reason == "tool_use"
    with client.messages.stream(model="tiny", max_tokens=200, messages=HI) as stream:
        assert "".join(stream.text_stream) == ANSWER
    assert client.messages.count_tokens(model="tiny", messages=HI).input_tokens == tokens(
        HI[0]["content"]
    )
    without = llama.post("/v1/messages", json={"model": "tiny"})
    assert (without.status_code, without.json()) == (
        500,
        {"error": {"code": 500, "message": "'messages' is required", "type": "server_error"}},
    )


def test_llama_builds_before_the_apis(engines: Engines, gguf: Path) -> None:
    not_found = {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}
    older = engines.start_llama(7000, SERVED, gguf)
    older.wait_status(200)
    for path in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
        refused = older.post(path, json={"messages": HI, "input": "Hi"})
        assert (refused.status_code, refused.json()) == (404, not_found), path
    between = engines.start_llama(7200, SERVED, gguf)
    between.wait_status(200)
    assert between.post("/v1/messages", json={"messages": HI}).status_code == 200
    assert between.post("/v1/responses", json={"input": "Hi"}).status_code == 404


def test_metrics_count_both_apis(vllm: Engine) -> None:
    before = parse_metric(vllm.get("/metrics").text, "vllm:request_success_total")
    vllm.openai().responses.create(model="tiny", input="Hello")
    claude(vllm).messages.create(model="tiny", max_tokens=50, messages=HI)
    after = parse_metric(vllm.get("/metrics").text, "vllm:request_success_total")
    assert after - before == 2
