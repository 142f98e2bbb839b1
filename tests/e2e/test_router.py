"""The router end to end: `capyctl start standalone` on simulated GPUs, the engine simulator
as vLLM and SGLang (real processes), and the openai SDK as the client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from capycommon.state import keys
from cluster import FOURTEEN, HOST, SMALL, Cluster, running
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine
from support import cancel, held_chat, wait_for, wait_for_async

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
HI: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def one_gpu() -> Iterator[Cluster]:
    with running("router", routing={"max_pending_per_deployment": 40}) as cluster:
        yield cluster


def _calls(calls: list[Any] | None) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in calls or []]


def sdk(cluster: Cluster, timeout: float = 120) -> openai.OpenAI:
    return cluster.openai(timeout)


def test_answers_are_the_engines_own(cluster: Cluster) -> None:
    cluster.deploy(
        "tools",
        engine="tools",
        model="small",
        engine_config={**SMALL, "tool_call_parser": "hermes", "reasoning_parser": "qwen3"},
    )
    client = sdk(cluster)
    # Through the router, not streamed: the first request starts the model.
    raw = client.chat.completions.with_raw_response.create(model="tools", messages=HI, tools=TOOLS)
    answer = raw.parse()
    assert raw.headers["X-CapyCTL-Request-Id"] == answer.id
    assert answer.model == "tools"
    url, secret = cluster.engine("tools")
    engine = openai.OpenAI(base_url=f"{url}/v1", api_key=secret, max_retries=0)
    cluster.clients.append(engine)
    own = engine.chat.completions.create(model="tools", messages=HI, tools=TOOLS)
    mine, theirs = answer.choices[0], own.choices[0]
    assert mine.message.content == theirs.message.content
    assert mine.finish_reason == theirs.finish_reason == "tool_calls"
    assert _calls(mine.message.tool_calls) == _calls(theirs.message.tool_calls)
    assert mine.message.tool_calls
    assert answer.usage == own.usage
    # Streamed, with usage: the same content, every chunk with the router's id.
    usage: Any = {"include_usage": True}
    chunks = list(
        client.chat.completions.create(
            model="tools", messages=HI, stream=True, stream_options=usage
        )
    )
    own_chunks = list(
        engine.chat.completions.create(
            model="tools", messages=HI, stream=True, stream_options=usage
        )
    )

    def text(found: list[Any]) -> str:
        return "".join(c.choices[0].delta.content or "" for c in found if c.choices)

    def reasoning(found: list[Any]) -> str:
        deltas = [c.choices[0].delta.model_extra or {} for c in found if c.choices]
        return "".join(d.get("reasoning") or d.get("reasoning_content") or "" for d in deltas)

    assert text(chunks) == text(own_chunks) != ""
    assert reasoning(chunks) == reasoning(own_chunks) != ""
    assert chunks[-1].usage == own_chunks[-1].usage
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].id.startswith("chatcmpl-")
    # Without include_usage, no usage chunk.
    plain = list(client.chat.completions.create(model="tools", messages=HI, stream=True))
    assert all(c.usage is None for c in plain)
    assert text(plain) == text(own_chunks)
    # Completions are forwarded too.
    completion = client.completions.create(model="tools", prompt="hi", max_tokens=8)
    own_completion = engine.completions.create(model="tools", prompt="hi", max_tokens=8)
    assert completion.choices[0].text == own_completion.choices[0].text != ""
    assert completion.usage == own_completion.usage
    # And embeddings, never streamed.
    vectors = client.embeddings.create(model="tools", input=["a", "b"])
    own_vectors = engine.embeddings.create(model="tools", input=["a", "b"])
    assert [v.embedding for v in vectors.data] == [v.embedding for v in own_vectors.data]
    assert vectors.model == "tools"
    assert vectors.usage == own_vectors.usage


def test_a_request_for_a_parked_model_wakes_it(cluster: Cluster) -> None:
    cluster.deploy("sleepy", model="small", engine_config=SMALL)
    cluster.start("sleepy")
    cluster.ok("park", "deployment", "sleepy", "--wait")
    answer = sdk(cluster).chat.completions.create(model="sleepy", messages=HI)
    assert answer.choices[0].message.content == "Hello from the engine simulator."
    assert cluster.state("sleepy") == "ready"
    woke = [to for _, to, _ in cluster.transitions("sleepy")]
    assert woke[-2:] == ["waking", "ready"]
    models = sdk(cluster).models.list()
    assert "sleepy" in [m.id for m in models.data]


def test_a_run_of_requests_asks_redis_for_a_place_once_per_worker(cluster: Cluster) -> None:
    """Each router worker keeps the place of a request that ended as a spare and lets its
    next requests through on it: twenty requests in a row run the admission script at most
    once a worker (two); a park right after finds no request running and the spares back."""
    cluster.deploy("steady", model="small", engine_config=SMALL)
    cluster.start("steady")
    client = sdk(cluster)
    taking = keys.instance(HOST, "steady", 0)  # only the admission script reads the record
    redis = cluster.client
    try:
        redis.config_set("slowlog-max-len", 10_000)
        redis.config_set("slowlog-log-slower-than", 0)  # every command
        redis.slowlog_reset()
        for i in range(20):
            if i % 2:
                chunks = client.chat.completions.create(model="steady", messages=HI, stream=True)
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                assert client.chat.completions.create(model="steady", messages=HI).choices
        logged = redis.slowlog_get(10_000)
        redis.config_set("slowlog-log-slower-than", 10_000)
        commands = [_text(entry["command"]) for entry in logged]
        takes = [c for c in commands if c.upper().startswith("EVALSHA") and taking in c]
        assert 1 <= len(takes) <= 2, f"{len(takes)} admissions through Redis for 20 requests"
        cluster.ok("park", "deployment", "steady", "--wait")
        found = cluster.places("steady")
        assert (found.running, found.spare) == (0, 0)
    finally:
        redis.close()


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def test_100_concurrent_requests_over_three_models_that_do_not_fit_together(
    cluster: Cluster,
) -> None:
    for name in "xyz":
        cluster.deploy(name, engine_config=FOURTEEN)
    client = sdk(cluster, timeout=300)

    def ask(i: int) -> str:
        model = "xyz"[i % 3]
        answer = client.chat.completions.create(model=model, messages=HI, stream=i % 2 == 0)
        if isinstance(answer, openai.Stream):
            return "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        return answer.choices[0].message.content or ""

    with ThreadPoolExecutor(max_workers=100) as pool:
        answers = list(pool.map(ask, range(100)))
    assert answers == ["Hello from the engine simulator."] * 100
    for name in "xyz":
        states = [to for _, to, _ in cluster.transitions(name)]
        assert "failed" not in states


def test_queue_full_at_the_bound(cluster: Cluster) -> None:
    cluster.deploy("late", engine="slowload", model="small", engine_config=SMALL)

    async def flood() -> list[httpx.Response | Exception]:
        headers = {"Authorization": f"Bearer {cluster.api_key}"}
        body = {"model": "late", "messages": HI}
        async with httpx.AsyncClient(base_url=cluster.base_url, headers=headers, timeout=4) as http:

            async def one() -> httpx.Response | Exception:
                try:
                    return await http.post("/chat/completions", json=body)
                except httpx.TimeoutException as exc:
                    return exc

            return await asyncio.gather(*(one() for _ in range(41)))

    results = asyncio.run(flood())
    full = [r for r in results if isinstance(r, httpx.Response)]
    assert len(full) == 1, "40 wait, the 41st is refused at once"
    assert full[0].status_code == 429
    assert full[0].headers["Retry-After"] == "1"
    assert full[0].json()["error"]["code"] == "queue_full"
    assert cluster.status("late")["state"] in ("pending", "starting"), "the start was asked for"


def _hang_up(cluster: Cluster, name: str, stream: bool, after_first: bool) -> None:
    """Send a request, hang up (after its first token, or before any: the connection is
    closed as a cancelled client closes it), and check the engine stops working on it within
    a second."""
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    # 30 s at 8 tokens/s: still running when a loaded machine's hostd reads the engine's load.
    body = {"model": name, "messages": HI, "stream": stream, "max_tokens": 240, "ignore_eos": True}

    async def cut() -> None:
        async with httpx.AsyncClient(
            base_url=cluster.base_url, headers=headers, timeout=30
        ) as http:
            first = asyncio.Event()
            answered: list[str] = []  # the router's status, and its first line

            async def send() -> None:
                async with http.stream("POST", "/chat/completions", json=body) as response:
                    answered.append(str(response.status_code))
                    # Held until the hang-up: a line iterator left behind is finalized at
                    # once, and its finalization closes the connection (a hang-up too soon).
                    lines = response.aiter_lines()
                    if stream and after_first:
                        async for line in lines:
                            if line:
                                answered.append(line[:300])
                                first.set()
                                break
                    await asyncio.Event().wait()  # held until the hang-up cancels it

            def engine_has_it() -> bool:
                if answered and answered[0] != "200":
                    raise AssertionError(f"the router answered {answered}")
                return cluster.engine_running(name) == 1

            generated = cluster.engine_generated(name)
            task = asyncio.create_task(send())
            try:
                await asyncio.to_thread(
                    wait_for, engine_has_it, timeout=20, what="the engine to get the request"
                )
            except AssertionError as exc:
                requests = cluster.status(name)["requests"]
                raise AssertionError(
                    f"{exc}; the client saw {answered}; the router counts {requests}; the "
                    f"engine's metrics: {_load_lines(cluster.engine_metrics(name))}"
                ) from None
            if stream and after_first:
                await asyncio.wait_for(first.wait(), 10)
            if after_first and not stream:  # tokens are being made for the collected answer
                await asyncio.to_thread(
                    wait_for,
                    lambda: cluster.engine_generated(name) > generated,
                    timeout=10,
                    what="the engine to make a token of the collected answer",
                )
            await cancel(task)

    asyncio.run(cut())
    wait_for(
        lambda: cluster.engine_running(name) == 0,
        timeout=1.0,
        what="the engine to stop the cut request's work",
    )


def _load_lines(metrics: str) -> list[str]:
    return [line for line in metrics.splitlines() if "num_requests" in line]


def test_a_client_hang_up_stops_the_engines_work(cluster: Cluster) -> None:
    cluster.deploy("slow", engine="slow", model="small", engine_config=SMALL)
    cluster.start("slow")
    for stream in (True, False):
        _hang_up(cluster, "slow", stream=stream, after_first=True)
        # Its place comes back once hostd reads the engine idle (a loaded machine reads late);
        # the next request would wait for it.
        wait_for(
            lambda: cluster.status("slow")["requests"]["running"] == 0,
            timeout=30,
            what="a cut request the engine answered to settle once it reads idle",
        )
    # A 5 s prefill: the engine has the request and has sent nothing yet.
    cluster.deploy("hang", engine="prefill", model="small", engine_config=SMALL)
    cluster.start("hang")
    for stream in (True, False):
        _hang_up(cluster, "hang", stream=stream, after_first=False)
    requests = cluster.status("hang")["requests"]
    assert requests["settle_at_stop"] == 2, "cut before any answer: counted until a stop"
    assert requests["running"] == 2
    shown = cluster.ok("status", "deployment", "hang").splitlines()
    assert "requests.settle_at_stop    2" in shown, "the text status says how they settle"
    assert "requests.settle_when_idle  0" in shown
    stopped = cluster.ok("stop", "deployment", "hang", "--wait").splitlines()
    assert stopped[0] == "Deployment hang is stopped."
    assert "state       stopped" in stopped
    cluster.start("hang")
    assert cluster.status("hang")["requests"]["settle_at_stop"] == 0, "the stop settled them"


def test_cut_requests_that_fill_every_place_restart_the_instance_never_queue_full(
    cluster: Cluster,
) -> None:
    """Requests cut before any answer wait for the instance's next stop to settle (vLLM
    says nothing of their end); when they hold all 32 of a model's places, the instance
    restarts, which settles them, and the next request is served."""
    crawl = Behaviour(load_seconds=0.5, tokens_per_second=4, answer=" ".join(["w"] * 400))
    install = install_python_engine(cluster.root / "e" / "crawl", "vllm", "0.29.0", crawl)
    cluster.ok("engine", "add", str(install), "--name", "crawl")
    cluster.deploy("full", engine="crawl", model="small", engine_config=SMALL)
    cluster.start("full")
    instance = cluster.instance("full")
    assert instance is not None
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    # Not streamed, 100 s of answer: nothing of it has come back when each is cut.
    body = {"model": "full", "messages": HI, "max_tokens": 400, "ignore_eos": True}

    async def cut_32() -> None:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(
            base_url=cluster.base_url, headers=headers, timeout=60, limits=limits
        ) as http:
            sent = [
                asyncio.create_task(http.post("/chat/completions", json=body)) for _ in range(32)
            ]

            async def all_in() -> bool:
                return (await asyncio.to_thread(cluster.places, "full")).running == 32

            await wait_for_async(all_in, timeout=30, what="32 requests to hold every place")
            for task in sent:
                await cancel(task)

    asyncio.run(cut_32())
    wait_for(
        lambda: _places_of(cluster, "full") == (32, 0, 32),
        timeout=15,
        what="the 32 cut requests to wait for the next stop",
    )
    answer = sdk(cluster).chat.completions.create(model="full", messages=HI, max_tokens=4)
    assert answer.choices[0].message.content, "served, not queue_full"
    restarted = cluster.instance("full")
    assert restarted is not None
    assert restarted.generation > instance.generation
    reasons = [choice["reason"] for choice in cluster.choices("full")]
    assert "cancelled requests hold every place: restarting it" in reasons, reasons
    assert cluster.status("full")["requests"]["settle_at_stop"] == 0, "the restart settled them"


def _places_of(cluster: Cluster, name: str) -> tuple[int, int, int]:
    found = cluster.places(name)
    return found.running, found.settle_when_idle, found.settle_at_stop


def test_sglang_aborts_a_cut_request_by_its_id(cluster: Cluster) -> None:
    cluster.deploy("sg", engine="slowsglang", model="small", engine_config=SMALL)
    cluster.start("sg")
    before = cluster.engine_aborted("sg")
    for stream in (True, False):
        _hang_up(cluster, "sg", stream=stream, after_first=True)
    assert cluster.engine_aborted("sg") == before + 2, "aborted by rid, not by the lagging hang-up"


def test_sglang_settles_a_cut_request_when_the_engine_ends_it(cluster: Cluster) -> None:
    """SGLang 0.5.22: a cut request's place comes back once hostd reports that the engine
    ended it, answered or cut before any answer (the engine held it), while another request
    keeps the engine busy, so it never reads idle."""
    slow = Behaviour(
        load_seconds=0.5, tokens_per_second=8, prefill_seconds=1.5, answer=" ".join(["word"] * 400)
    )
    install = install_python_engine(cluster.root / "e" / "sg22", "sglang", "0.5.22", slow)
    cluster.ok("engine", "add", str(install), "--name", "sg22")
    cluster.deploy("sg22", engine="sg22", model="small", engine_config=SMALL)
    cluster.start("sg22")
    headers = {"Authorization": f"Bearer {cluster.api_key}"}

    async def scenario() -> list[tuple[str, float]]:
        async with httpx.AsyncClient(
            base_url=cluster.base_url, headers=headers, timeout=60
        ) as http:

            def send(
                max_tokens: int, first_token: asyncio.Event | None
            ) -> Coroutine[Any, Any, None]:
                body = {"model": "sg22", "messages": HI, "stream": True, "max_tokens": max_tokens}
                return held_chat(http, body, first_token)

            async def engine_runs(count: int) -> None:
                async def runs() -> bool:
                    return await asyncio.to_thread(cluster.engine_running, "sg22") == count

                await wait_for_async(runs, timeout=15, what=f"the engine to run {count}")

            busy = asyncio.create_task(send(400, None))
            await engine_runs(1)
            settled: list[tuple[str, float]] = []
            for answered in (True, False):
                token = asyncio.Event() if answered else None
                task = asyncio.create_task(send(200, token))
                await engine_runs(2)  # the engine holds it (prefill first)
                if token is not None:
                    await asyncio.wait_for(token.wait(), 10)
                await cancel(task)
                cut_at = time.monotonic()
                field, back_at = await asyncio.to_thread(_raised_then_back, cluster)
                settled.append((field, back_at - cut_at))
                assert field == ("settle_when_idle" if answered else "settle_at_stop")
                assert _places(cluster) == (1, 0, 0), "capyctl status shows it settled"
                assert await asyncio.to_thread(cluster.engine_running, "sg22") == 1
                assert not busy.done(), "the long request still runs: the engine never read idle"
            await cancel(busy)
            return settled

    for field, seconds in asyncio.run(scenario()):
        print(f"{field}: settled {seconds:.3f} s after the cut")


def _raised_then_back(cluster: Cluster) -> tuple[str, float]:
    """Watch the places hash (what status shows): the cut request counted in one settle
    field, then settled while the other request runs; which field, and when it settled.
    Polled every 5 ms: the raised field may hold for a moment only."""
    raised: list[str] = []

    def settled() -> tuple[str, float] | None:
        found = cluster.places("sg22")
        if not raised and found.settle_when_idle + found.settle_at_stop == 1:
            raised.append("settle_when_idle" if found.settle_when_idle else "settle_at_stop")
        if raised and (found.running, found.settle_when_idle, found.settle_at_stop) == (1, 0, 0):
            return raised[0], time.monotonic()
        return None

    try:
        return wait_for(settled, timeout=10, what="the cut request to settle", interval=0.005)
    except AssertionError:
        left = cluster.places("sg22")
        raise AssertionError(f"the cut request did not settle: {left}") from None


def _places(cluster: Cluster) -> tuple[int, int, int]:
    requests = cluster.status("sg22")["requests"]
    return requests["running"], requests["settle_when_idle"], requests["settle_at_stop"]


def test_refusals_in_the_openai_envelope(cluster: Cluster) -> None:
    cluster.deploy("halt", model="small", engine_config=SMALL)
    admin = cluster.role.credentials()["admin_token"]
    for key in ("wrong", admin):
        with (
            openai.OpenAI(base_url=cluster.base_url, api_key=key, max_retries=0) as refused,
            pytest.raises(openai.AuthenticationError),
        ):
            refused.models.list()
    client = sdk(cluster)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nosuch", messages=HI)
    assert missing.value.code == "unknown_model"
    cluster.ok("stop", "deployment", "halt", "--wait")
    with pytest.raises(openai.ConflictError) as stopped:
        client.chat.completions.create(model="halt", messages=HI)
    assert stopped.value.code == "deployment_stopped"
    assert "halt" not in [m.id for m in client.models.list().data]
    huge = httpx.post(
        f"{cluster.base_url}/chat/completions",
        headers={"Authorization": f"Bearer {cluster.api_key}"},
        content=b"x" * (5 << 20),
    )
    assert huge.status_code == 413
    assert huge.json()["error"]["code"] == "body_too_large"
    for path in ("/sleep", "/wake_up", "/collective_rpc", "/abort_request"):
        found = httpx.post(
            f"http://{cluster.role.inference}{path}",
            headers={"Authorization": f"Bearer {cluster.api_key}"},
        )
        assert found.status_code in (404, 405), f"{path} is not an engine path here"


def test_an_engines_refusal_is_a_400_streamed_or_not(cluster: Cluster) -> None:
    """vLLM refuses max_tokens beyond the context before it streams, and logprobs above 20
    as the first event of a stream it has answered 200; SGLang refuses in its flat shape.
    The client gets each as the engine's 400 in the OpenAI envelope, streamed or not."""
    cluster.deploy("strict", model="small", engine_config=SMALL)
    cluster.deploy("flat", engine="sglang", model="small", engine_config=SMALL)
    client = sdk(cluster)
    refusals: list[tuple[str, dict[str, Any], str]] = [
        (
            "strict",
            {"max_tokens": 1_000_000},
            "'max_tokens' or 'max_completion_tokens' is too "
            "large: 1000000. This model's maximum context length is",
        ),
        (
            "strict",
            {"logprobs": True, "top_logprobs": 30},
            "Requested sample logprobs of 30, which is greater than max allowed: 20",
        ),
        ("flat", {"max_tokens": -1}, "max_tokens: Input should be greater than or equal to 0"),
    ]
    for model, fields, message in refusals:
        for stream in (True, False):
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=model, messages=HI, stream=stream, **fields)
            assert refused.value.status_code == 400
            assert refused.value.code == "engine_rejected"
            assert refused.value.type == "invalid_request_error"
            assert message in refused.value.message, (model, stream)
    for name in ("strict", "flat"):
        assert cluster.status(name)["requests"]["running"] == 0, "each place came back"


def test_metrics(cluster: Cluster) -> None:
    cluster.deploy("counted", model="small", engine_config=SMALL)
    sdk(cluster).chat.completions.create(model="counted", messages=HI)
    text = httpx.get(
        f"http://{cluster.role.inference}/metrics",
        headers={"Authorization": f"Bearer {cluster.api_key}"},
    ).text
    assert (
        'capyctl_requests_total{deployment="counted",outcome="ok",route="chat.completions"} 1.0'
        in text
    )
    assert 'capyctl_time_to_first_token_seconds_count{deployment="counted"} 1.0' in text
    assert 'capyctl_lifecycle_seconds_count{deployment="counted",operation="start"} 1.0' in text
    assert httpx.get(f"http://{cluster.role.inference}/metrics").status_code == 401
