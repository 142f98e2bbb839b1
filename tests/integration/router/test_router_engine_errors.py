"""The router in process (real Redis, the real app) in front of engines that answer with
errors, in each family's exact shape; the openai SDK as the client. Before the engine's first
event every failure is the engine's own status in the OpenAI envelope, streamed or not; after
it, an error event and `[DONE]`. And what the engines get of a client's `cache_salt`: its
digest, or, on llama.cpp, a refusal that never reaches the engine."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
import redis.asyncio as aioredis

from capycommon.credentials import generate
from capycommon.engineclient import Engines
from capycommon.state.stores import State
from capyctl_router.app import Router, create_app
from capyctl_router.dispatch import Dispatcher
from capyctl_router.metrics import Metrics
from capyctl_router.relay import salt_digest
from capyctl_router.table import Table
from integration.router.fakeengine import engine_serving
from integration.router.ready import chunk, put_ready
from support import cache_record

CREDENTIALS = generate()
HOST = "local"
# An LMCache server beside an engine, as hostd records it.
LMCACHE = cache_record()
HI: list[Any] = [{"role": "user", "content": "hi"}]
TOO_LONG = (
    "'max_tokens' or 'max_completion_tokens' is too large: 9000. This model's maximum "
    "context length is 4096 tokens and your request has 2 input tokens (9000 > 4096 - 2)."
)
# What each family answers to a request it refuses before streaming.
REFUSALS = {
    "vllm": {"error": {"message": TOO_LONG, "type": "BadRequestError", "param": None, "code": 400}},
    "sglang": {
        "object": "error",
        "message": TOO_LONG,
        "type": "BadRequest",
        "param": None,
        "code": 400,
    },
    "llamacpp": {"error": {"code": 400, "message": TOO_LONG, "type": "invalid_request_error"}},
}
Engine = Callable[[httpx.Request], httpx.Response]


def _sse(*events: str) -> httpx.Response:
    body = "".join(events).encode()
    return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})


def _error_event(message: str, code: int) -> str:
    error = {
        "message": message,
        "type": "BadRequestError" if code < 500 else "InternalServerError",
        "param": None,
        "code": code,
    }
    return f"data: {json.dumps({'error': error})}\n\n"


def _engine_error(message: str) -> dict[str, Any]:
    """The OpenAI error object the router answers an engine's failure with."""
    return {"message": message, "type": "server_error", "param": None, "code": "engine_error"}


class Cluster:
    """One ready deployment per family, all served by `engine` (a fake engine's answer)."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.engine: Engine = lambda _: _sse(chunk("hello", "stop"), "data: [DONE]\n\n")
        self.seen: list[dict[str, Any]] = []

    async def ready(self, family: str, port: int) -> None:
        await put_ready(self.state.client, family, family=family, host=HOST, port=port)

    def answer(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(json.loads(request.content))
        return self.engine(request)

    async def running(self, name: str) -> int:
        return (await self.state.places.get(name)).running


@pytest.fixture
async def cluster(redis_socket: Path) -> AsyncIterator[tuple[Cluster, openai.AsyncOpenAI]]:
    state = State(aioredis.Redis(unix_socket_path=str(redis_socket)))
    cluster = Cluster(state)
    engines = Engines()
    async with engine_serving(cluster.answer) as port:
        for family in REFUSALS:
            await cluster.ready(family, port)
        await put_ready(state.client, "sglang-lmcache", "sglang", HOST, port, cache=LMCACHE)
        table = Table(state, {HOST})
        await table.sync()
        app = create_app(CREDENTIALS, Router(Dispatcher(state, table, Metrics()), engines))
        # The openai SDK's own HTTP client package (a fork of httpx), with the app as transport.
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://router")
        sdk = openai.AsyncOpenAI(
            base_url="http://router/v1",
            api_key=CREDENTIALS.api_key,
            http_client=http,
            max_retries=0,
        )
        try:
            yield cluster, sdk
        finally:
            await sdk.close()
            engines.close()
            await state.client.aclose()


@pytest.fixture
def engines(cluster: tuple[Cluster, openai.AsyncOpenAI]) -> Cluster:
    """The fake engines behind the cluster's deployments."""
    return cluster[0]


@pytest.fixture
def sdk(cluster: tuple[Cluster, openai.AsyncOpenAI]) -> openai.AsyncOpenAI:
    """The openai SDK, the router's client."""
    return cluster[1]


@pytest.mark.anyio
@pytest.mark.parametrize("family", sorted(REFUSALS))
@pytest.mark.parametrize("stream", [True, False])
async def test_an_engines_refusal_is_its_400_streamed_or_not(
    engines: Cluster, sdk: openai.AsyncOpenAI, family: str, stream: bool
) -> None:
    engines.engine = lambda _: httpx.Response(400, json=REFUSALS[family])
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.chat.completions.create(model=family, messages=HI, max_tokens=9000, stream=stream)
    assert refused.value.status_code == 400
    assert refused.value.body == {
        "message": TOO_LONG,
        "type": "invalid_request_error",
        "param": None,
        "code": "engine_rejected",
    }
    assert refused.value.response.headers["X-CapyCTL-Request-Id"].startswith("chatcmpl-")
    assert engines.seen[-1]["stream"] is True, "the router always streams from the engine"
    assert await engines.running(family) == 0, "the engine is done with it: its place is back"


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False])
async def test_an_error_as_the_first_event_after_200_is_that_errors_status(
    engines: Cluster, sdk: openai.AsyncOpenAI, stream: bool
) -> None:
    message = "Requested sample logprobs of 30, which is greater than max allowed: 20"
    engines.engine = lambda _: _sse(_error_event(message, 400), "data: [DONE]\n\n")
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.chat.completions.create(
            model="vllm", messages=HI, stream=stream, logprobs=True, top_logprobs=30
        )
    assert refused.value.status_code == 400
    assert refused.value.message.endswith(message)
    assert refused.value.code == "engine_rejected"
    assert await engines.running("vllm") == 0


@pytest.mark.anyio
async def test_an_engine_5xx_keeps_its_status_and_a_401_is_the_routers_problem(
    engines: Cluster, sdk: openai.AsyncOpenAI
) -> None:
    loading = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    engines.engine = lambda _: httpx.Response(503, json=loading)
    for stream in (True, False):
        with pytest.raises(openai.InternalServerError) as failed:
            await sdk.chat.completions.create(model="llamacpp", messages=HI, stream=stream)
        assert failed.value.status_code == 503
        assert failed.value.response.headers["Retry-After"] == "1"
        assert failed.value.body == _engine_error("Loading model")
    engines.engine = lambda _: httpx.Response(401, json={"error": "Unauthorized"})
    with pytest.raises(openai.InternalServerError) as refused:
        await sdk.chat.completions.create(model="vllm", messages=HI, stream=True)
    assert refused.value.status_code == 500, "not an AuthenticationError for a good API key"


@pytest.mark.anyio
async def test_after_the_first_event_a_failure_is_an_error_event_and_done(
    engines: Cluster, sdk: openai.AsyncOpenAI
) -> None:
    broken = _error_event("EngineCore encountered an issue.", 500)
    engines.engine = lambda _: _sse(chunk("Hello"), chunk(" there"), broken, "data: [DONE]\n\n")
    async with sdk.chat.completions.with_streaming_response.create(
        model="vllm", messages=HI, stream=True
    ) as response:
        assert response.http_response.status_code == 200
        lines = [line async for line in response.http_response.aiter_lines() if line]
    assert [json.loads(line[6:])["choices"][0]["delta"]["content"] for line in lines[:2]] == [
        "Hello",
        " there",
    ]
    assert json.loads(lines[2][6:]) == {"error": _engine_error("EngineCore encountered an issue.")}
    assert lines[3:] == ["data: [DONE]"]
    with pytest.raises(openai.APIError, match="EngineCore encountered an issue"):
        async for _ in await sdk.chat.completions.create(model="vllm", messages=HI, stream=True):
            pass
    # Not streamed, nothing has gone to the client yet: the engine's status.
    with pytest.raises(openai.InternalServerError) as failed:
        await sdk.chat.completions.create(model="vllm", messages=HI)
    assert failed.value.status_code == 500
    assert await engines.running("vllm") == 0


@pytest.mark.anyio
async def test_a_stream_the_engine_ends_without_done_still_ends_with_done(
    engines: Cluster, sdk: openai.AsyncOpenAI
) -> None:
    engines.engine = lambda _: _sse(chunk("Hi", "stop"))
    chunks = [
        chunk
        async for chunk in await sdk.chat.completions.create(
            model="sglang", messages=HI, stream=True
        )
    ]
    assert [c.choices[0].delta.content for c in chunks] == ["Hi"]
    assert chunks[0].model == "sglang"
    answer = await sdk.chat.completions.create(model="sglang", messages=HI)
    assert answer.choices[0].message.content == "Hi"


@pytest.mark.anyio
async def test_a_cache_salt_reaches_the_engine_as_a_digest_of_the_deployment_and_revision(
    engines: Cluster, sdk: openai.AsyncOpenAI
) -> None:
    salted = {"cache_salt": "tenant-a"}
    for family in ("vllm", "sglang"):
        await sdk.chat.completions.create(model=family, messages=HI, extra_body=salted)
    await sdk.chat.completions.create(model="vllm", messages=HI, extra_body=salted)
    await sdk.chat.completions.create(model="vllm", messages=HI, extra_body={"cache_salt": "b"})
    await sdk.chat.completions.create(model="vllm", messages=HI)
    sent = [body.get("cache_salt") for body in engines.seen]
    assert sent[0] == salt_digest("vllm", 1, "tenant-a")
    assert re.fullmatch(r"[0-9a-f]{64}", sent[0])
    assert sent[1] == salt_digest("sglang", 1, "tenant-a") != sent[0], "per deployment"
    assert sent[2] == sent[0], "the same for every request, and across restarts"
    assert sent[3] not in (sent[0], None), "per salt"
    assert sent[4] is None, "none when the client sent none"
    assert salt_digest("vllm", 2, "tenant-a") != sent[0], "per revision"


@pytest.mark.anyio
@pytest.mark.parametrize("salt", ["", 7])
async def test_a_cache_salt_that_is_not_a_non_empty_string_is_refused(
    engines: Cluster, sdk: openai.AsyncOpenAI, salt: object
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.chat.completions.create(
            model="vllm", messages=HI, extra_body={"cache_salt": salt}
        )
    assert "cache_salt" in refused.value.message
    assert engines.seen == [], "refused before it reached the engine"


async def _salt_refused(engines: Cluster, sdk: openai.AsyncOpenAI, model: str) -> str:
    """Asks `model` with a cache salt it cannot honour: refused as cache_salt_unsupported
    before any engine saw it, its place given back. Returns the reason given."""
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.chat.completions.create(
            model=model, messages=HI, extra_body={"cache_salt": "tenant-a"}
        )
    assert refused.value.code == "cache_salt_unsupported"
    assert engines.seen == [], "the engine never saw it"
    assert await engines.running(model) == 0, "its place came back"
    return refused.value.message


@pytest.mark.anyio
async def test_a_cache_salt_for_llamacpp_is_refused_with_its_reason(
    engines: Cluster, sdk: openai.AsyncOpenAI
) -> None:
    assert "llama.cpp" in await _salt_refused(engines, sdk, "llamacpp")


@pytest.mark.anyio
async def test_a_cache_salt_for_sglang_with_lmcache_is_refused_with_its_reason(
    engines: Cluster, sdk: openai.AsyncOpenAI
) -> None:
    reason = await _salt_refused(engines, sdk, "sglang-lmcache")
    assert "SGLang with LMCache" in reason
    assert "lmcache: off" in reason
    await sdk.chat.completions.create(model="sglang-lmcache", messages=HI)
    assert len(engines.seen) == 1, "without a salt it is served"
