"""Loading progress (`CapyCTL-Progress: on`) through a real standalone role: a streamed
request that waits for its model's start or wake gets SSE comment lines before its first
event, which the openai SDK reads past; a percentage once an earlier start's duration is
known; nothing without the header, for a request that is not streamed, or for a model that
is ready; a failure after the early 200 as the stream's error event, which the SDK raises;
a bad value refused; a hang-up while waiting leaves the queue."""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from capycommon.state import keys
from capycommon.state.stores import State
from cluster import SMALL, Cluster
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine
from support import wait_for

HI: list[Any] = [{"role": "user", "content": "hi"}]
ON = {"CapyCTL-Progress": "on"}
COMMENT = re.compile(r"^: capyctl (loading model \S+(, .+)?|waiting for a place on \S+)$")
SHARE = re.compile(r", (?:starting|waking) (\d+)%$")


@pytest.fixture(scope="module")
def loader(one_gpu: Cluster) -> str:
    """An engine that loads for 2 s and wakes in 1.5 s, so a waiting request sees each."""
    behaviour = Behaviour(load_seconds=2.0, wake_seconds=1.5, tokens_per_second=200)
    path = install_python_engine(one_gpu.root / "e" / "loader", "vllm", "0.29.0", behaviour)
    one_gpu.ok("engine", "add", str(path), "--name", "loader")
    return "loader"


def raw_stream(
    cluster: Cluster, model: str, headers: dict[str, str], stream: bool = True
) -> httpx.Response:
    """A chat request as bytes, read whole (the SDK would hide what is not an event)."""
    body = {"model": model, "messages": HI, "stream": stream, "max_tokens": 8}
    sent = {"Authorization": f"Bearer {cluster.api_key}", **headers}
    answer = httpx.post(f"{cluster.base_url}/chat/completions", json=body, headers=sent, timeout=60)
    answer.read()
    return answer


def blocks(answer: httpx.Response) -> list[str]:
    """The stream's blocks, each what came before a blank line; every block is one line."""
    text = answer.text
    assert text.endswith("\n\n"), text[-200:]
    found = text[:-2].split("\n\n")
    assert all("\n" not in block for block in found), found
    return found


def comments_then_events(answer: httpx.Response) -> tuple[list[str], list[str]]:
    """The comment lines before the first event, and the events (none a comment)."""
    found = blocks(answer)
    first = next(i for i, block in enumerate(found) if block.startswith("data: "))
    comments, events = found[:first], found[first:]
    assert all(COMMENT.match(line) for line in comments), comments
    assert all(block.startswith("data: ") for block in events), events
    assert events[-1] == "data: [DONE]"
    return comments, events


def text_of(events: list[str]) -> str:
    chunks = [httpx.Response(200, content=e.removeprefix("data: ")).json() for e in events[:-1]]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_a_cold_start_shows_progress_and_the_sdk_reads_the_stream_unchanged(
    cluster: Cluster, loader: str
) -> None:
    # restart_only: a park stops the engine, and the next request starts it cold.
    cluster.deploy(
        "cold", engine=loader, model="small", engine_config=SMALL, residency="restart_only"
    )
    client = cluster.openai()
    # The first start: the SDK yields the engine's chunks as it would without the header.
    stream = client.chat.completions.create(
        model="cold", messages=HI, stream=True, max_tokens=8, extra_headers=ON
    )
    chunks = list(stream)
    assert chunks
    assert all(chunk.model == "cold" for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason is not None
    said = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert said
    # A start again: its comments say how far along it is against the first start.
    cluster.ok("park", "deployment", "cold", "--wait")
    answer = raw_stream(cluster, "cold", ON)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    comments, events = comments_then_events(answer)
    assert comments[0].startswith(": capyctl loading model cold"), comments
    shares = [int(found[1]) for line in comments if (found := SHARE.search(line))]
    assert shares, f"no percentage in {comments}"
    assert shares == sorted(shares), shares
    assert shares[-1] <= 99, shares
    assert any(", starting " in line for line in comments), comments
    assert text_of(events) == said, "the same answer, streamed as without the header"
    # The model is ready: no comment at all, the header on or not.
    for headers in (ON, {}):
        comments, events = comments_then_events(raw_stream(cluster, "cold", headers))
        assert comments == []
        assert text_of(events) == said


def test_a_wake_shows_waking(cluster: Cluster, loader: str) -> None:
    cluster.deploy("sleepy", engine=loader, model="small", engine_config=SMALL)
    cluster.start("sleepy")
    cluster.ok("park", "deployment", "sleepy", "--wait")
    comments, events = comments_then_events(raw_stream(cluster, "sleepy", ON))
    assert any(re.search(r", waking( \d+%)?$", line) for line in comments), comments
    assert text_of(events)
    # The first wake's duration is known now: the next wake says how far along it is.
    cluster.ok("park", "deployment", "sleepy", "--wait")
    comments, _ = comments_then_events(raw_stream(cluster, "sleepy", ON))
    assert any(re.search(r", waking \d+%$", line) for line in comments), comments


def test_without_the_header_or_not_streamed_nothing_changes(cluster: Cluster, loader: str) -> None:
    cluster.deploy(
        "plain", engine=loader, model="small", engine_config=SMALL, residency="restart_only"
    )
    for headers in ({}, {"CapyCTL-Progress": "OFF"}):
        answer = raw_stream(cluster, "plain", headers)  # a cold start
        assert answer.status_code == 200
        assert b": capyctl" not in answer.content
        assert blocks(answer)[0].startswith("data: ")
        cluster.ok("park", "deployment", "plain", "--wait")
    # Not streamed, cold: one JSON body, as without the header.
    answer = raw_stream(cluster, "plain", ON, stream=False)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    with_header = answer.json()
    without = raw_stream(cluster, "plain", {}, stream=False).json()
    assert with_header["object"] == "chat.completion"
    assert sorted(with_header) == sorted(without)
    assert with_header["choices"][0]["message"] == without["choices"][0]["message"]


def test_a_failure_after_the_early_status_is_the_streams_error_event(
    cluster: Cluster,
) -> None:
    # The deadline passes while the model loads (for a minute).
    cluster.deploy("late", engine="slowload", model="small", request_deadline="2s")
    client = cluster.openai(timeout=60)
    with ThreadPoolExecutor(1) as pool:
        plain = pool.submit(raw_stream, cluster, "late", {})
        stream = client.chat.completions.create(
            model="late", messages=HI, stream=True, extra_headers=ON
        )
        with pytest.raises(openai.APIError) as raised:
            list(stream)
        refused = plain.result()
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert raised.value.code == error["code"] == "unavailable"
    assert raised.value.message == error["message"]
    assert "request deadline" in error["message"]
    # An operator stops the model while requests wait for it: the one that got its status
    # early sees the refusal as the error event, then [DONE].
    cluster.deploy("halt", engine="slowload", model="small")
    headers = {"Authorization": f"Bearer {cluster.api_key}", **ON}
    body = {"model": "halt", "messages": HI, "stream": True}
    with httpx.stream(
        "POST", f"{cluster.base_url}/chat/completions", json=body, headers=headers, timeout=60
    ) as answer:
        assert answer.status_code == 200
        lines = answer.iter_lines()
        assert next(lines) == ": capyctl loading model halt"
        cluster.ok("stop", "deployment", "halt")
        rest = [line for line in lines if line and not line.startswith(":")]
    assert len(rest) == 2, rest
    assert rest[-1] == "data: [DONE]"
    error = httpx.Response(200, content=rest[0].removeprefix("data: ")).json()["error"]
    assert error["code"] == "deployment_stopped"
    assert error["type"] == "invalid_request_error"
    assert "capyctl start deployment halt" in error["message"]


def test_a_bad_value_is_refused_naming_the_header(cluster: Cluster) -> None:
    cluster.deploy("any", model="small", engine_config=SMALL)
    for value in ("yes", "1", ""):
        answer = raw_stream(cluster, "any", {"CapyCTL-Progress": value})
        assert answer.status_code == 400, value
        error = answer.json()["error"]
        assert error["code"] == "invalid_request"
        assert "CapyCTL-Progress" in error["message"]
        assert "send on" in error["message"]
    assert cluster.state("any") is None, "a refused request asks for nothing"


def test_a_hang_up_while_waiting_leaves_the_queue(cluster: Cluster) -> None:
    cluster.deploy("gone", engine="slowload", model="small")

    async def hang_up() -> None:
        headers = {"Authorization": f"Bearer {cluster.api_key}", **ON}
        body = {"model": "gone", "messages": HI, "stream": True}
        async with (
            httpx.AsyncClient(base_url=cluster.base_url, headers=headers) as http,
            http.stream("POST", "/chat/completions", json=body) as answer,
        ):
            # Held until the hang-up: the connection closes as the `with` ends.
            lines = answer.aiter_lines()
            first = await anext(lines)
            assert first.startswith(": capyctl loading model gone")
            assert await waiting(cluster) == 1

    asyncio.run(hang_up())
    try:
        wait_for(
            lambda: asyncio.run(waiting(cluster)) == 0,
            timeout=5,
            what="the request that hung up to leave the queue",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {asyncio.run(counted(cluster))}") from None


async def counted(cluster: Cluster) -> str:
    """Where a waiting request is counted: in Redis, by owner, and by each router worker's
    own count (its metrics)."""
    client = aioredis.Redis(unix_socket_path=str(cluster.role.state_dir / "redis/redis.sock"))
    try:
        found = await client.hgetall(keys.waiting())
    finally:
        await client.aclose()
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    async with httpx.AsyncClient() as http:
        metrics = await http.get(f"http://{cluster.role.inference}/metrics", headers=headers)
    own = [
        line for line in metrics.text.splitlines() if line.startswith("capyctl_requests_waiting")
    ]
    return f"Redis counts {found}; the router's workers count {own}"


async def waiting(cluster: Cluster) -> int:
    """The requests waiting for `gone`, over every router worker."""
    client = aioredis.Redis(unix_socket_path=str(cluster.role.state_dir / "redis/redis.sock"))
    try:
        return (await State(client).places.waiting()).get("gone", 0)
    finally:
        await client.aclose()
