"""The simulated vLLM, launched from a real install: forms, phases, API, sleep, memory, signals."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engines.simulator.helpers import (
    FAST,
    GIB,
    HELLO,
    MIB,
    REASONS_AND_CALLS,
    SLOW,
    Engine,
    Engines,
    Installs,
    Launcher,
    Servers,
    SimGpu,
    claim,
    closed_env,
    engine_core,
    env_for,
    group_alive,
    python_argv,
    send_and_hang_up,
    sse_events,
    streaming,
    wait_claim,
    with_group_killed,
)
from enginesim import Behaviour, write_behaviour
from enginesim.behaviour import GARBAGE_ANSWER
from support import pid_alive, wait_for

VERSION = "0.17.0"
WEIGHTS = 2 * GIB
RESIDUE = 512 * MIB
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
SERVED = REASONS_AND_CALLS.model_copy(update={"tokens_per_second": 100})
MIDDLEWARE = """
class Tagger:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-sim-class", b"yes")]
            await send(message)

        await self.app(scope, receive, tagged)


async def stamp(request, call_next):
    response = await call_next(request)
    response.headers["x-sim-func"] = "yes"
    return response
"""
LOOPBACK = ("--host", "127.0.0.1")


def api_server(venv: Path, model: Path, *extra: str) -> list[str]:
    return python_argv("vllm", venv, model, *LOOPBACK, *extra)


def start(
    engines: Engines, behaviour: Behaviour, *extra: str, version: str = VERSION, **env: str
) -> Engine:
    """vLLM's API server on loopback, launched (it may still be loading)."""
    return engines.start("vllm", version, behaviour, *LOOPBACK, *extra, **env)


def budget(gpu: SimGpu, fraction: float = 0.9) -> int:
    return int(fraction * gpu.total)


@pytest.fixture(scope="module")
def served(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """One vLLM 0.17 with keys, two names, parsers, id headers and two --middleware."""
    folder = tmp_path_factory.mktemp("vllm-middleware")
    (folder / "sim_middleware.py").write_text(MIDDLEWARE)
    flags = [
        *LOOPBACK,
        "--served-model-name",
        "tiny",
        "other",
        "--enable-sleep-mode",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--enable-request-id-headers",
        "--max-num-seqs",
        "8",
        "--middleware",
        "sim_middleware.Tagger",
        "--middleware",
        "sim_middleware.stamp",
    ]
    env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(folder)}
    with servers.python("vllm-served", "vllm", VERSION, SERVED, *flags, env=env) as engine:
        yield engine


def test_auth_guards_only_the_api_prefixes(served: Engine) -> None:
    bare = httpx.get(f"{served.base}/v1/models")
    assert (bare.status_code, bare.json()) == (401, {"error": "Unauthorized"})
    wrong = httpx.get(f"{served.base}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert served.get("/v1/models").status_code == 200
    for path in ("/health", "/metrics", "/version", "/load", "/is_sleeping", "/is_paused"):
        assert httpx.get(served.base + path).status_code == 200, path


def test_info_routes_have_vllm_shapes(served: Engine, model_dir: Path) -> None:
    health = httpx.get(f"{served.base}/health")
    assert (health.status_code, health.content) == (200, b"")
    assert (health.headers["x-sim-class"], health.headers["x-sim-func"]) == ("yes", "yes")
    assert httpx.post(f"{served.base}/ping").status_code == 200
    assert httpx.get(f"{served.base}/version").json() == {"version": VERSION}
    assert httpx.get(f"{served.base}/load").json() == {"server_load": 0}
    listing = served.get("/v1/models").json()
    assert listing["object"] == "list"
    assert [card["id"] for card in listing["data"]] == ["tiny", "other"]
    card = listing["data"][0]
    assert (card["owned_by"], card["root"], card["parent"]) == ("vllm", str(model_dir), None)
    assert card["max_model_len"] == 4096
    assert card["permission"][0]["id"].startswith("modelperm-")


def test_chat_through_the_openai_sdk(served: Engine) -> None:
    raw = served.openai().chat.completions.with_raw_response.create(
        model="tiny", messages=HELLO, extra_headers={"X-Request-Id": "req-42"}
    )
    assert raw.headers["x-request-id"] == "req-42"
    completion = raw.parse()
    assert completion.id == "chatcmpl-req-42"
    assert completion.model == "tiny"
    choice = completion.choices[0]
    assert (choice.message.content, choice.finish_reason) == (SERVED.answer, "stop")
    extra = choice.message.model_extra or {}
    assert extra["reasoning"] == SERVED.reasoning
    assert "reasoning_content" not in extra  # gone from 0.16 on
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == 4  # 15 characters / 4
    assert completion.usage.completion_tokens == 3 + 5  # reasoning pieces + answer pieces


def test_stream_with_usage_through_the_openai_sdk(served: Engine) -> None:
    chunks = list(
        served.openai().chat.completions.create(
            model="tiny", messages=HELLO, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(d.content or "" for d in deltas) == SERVED.answer
    reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    assert reasoning == SERVED.reasoning
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == ["stop"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_tool_calls_in_one_body_and_streamed(served: Engine) -> None:
    client = served.openai()
    completion = client.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    call: Any = choice.message.tool_calls[0]
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    stream = client.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, stream=True)
    deltas = [chunk.choices[0] for chunk in stream if chunk.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert calls[0].id is not None
    assert calls[0].id.startswith("chatcmpl-tool-")
    assert calls[0].function is not None
    assert calls[0].function.name == "get_weather"
    assert calls[0].function.arguments is None
    arguments = "".join(c.function.arguments or "" for c in calls[1:] if c.function)
    assert json.loads(arguments) == {"city": "Paris"}
    assert deltas[-1].finish_reason == "tool_calls"
    plain = client.chat.completions.create(
        model="tiny", messages=HELLO, tools=TOOLS, tool_choice="none"
    )
    assert plain.choices[0].message.content == SERVED.answer


def test_errors_use_the_nested_envelope(served: Engine) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        served.openai().chat.completions.create(model="nope", messages=HELLO)
    assert caught.value.body == {
        "message": "The model `nope` does not exist.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
    bad = served.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "BadRequestError"


def test_refusals_before_and_inside_the_stream(served: Engine) -> None:
    """max_tokens beyond the context: 400 before anything streams. Logprobs above 20: found
    when the engine takes the request, so a stream answers 200 with the error first."""
    for stream in (False, True):
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 5000, "stream": stream}
        answer = served.post("/v1/chat/completions", json=body)
        assert answer.status_code == 400
        assert answer.json() == {
            "error": {
                "message": "'max_tokens' or 'max_completion_tokens' is too large: 5000. This "
                "model's maximum context length is 4096 tokens and your request has 4 input "
                "tokens (5000 > 4096 - 4).",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        }
    message = "Requested sample logprobs of 30, which is greater than max allowed: 20"
    body = {"model": "tiny", "messages": HELLO, "logprobs": True, "top_logprobs": 30}
    answer = served.post("/v1/chat/completions", json=body)
    assert (answer.status_code, answer.json()["error"]["message"]) == (400, message)
    with httpx.stream(
        "POST",
        f"{served.base}/v1/chat/completions",
        headers=served.headers,
        json={**body, "stream": True},
        timeout=30,
    ) as sent:
        assert sent.status_code == 200
        events = list(sse_events(sent.iter_lines()))
    assert events == [
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}},
        "[DONE]",
    ]


def test_text_completions(served: Engine) -> None:
    completion = served.openai().completions.create(model="tiny", prompt="Once upon", max_tokens=2)
    assert completion.id.startswith("cmpl-")
    assert completion.choices[0].text == "Hello from"
    assert completion.choices[0].finish_reason == "length"


def test_ignore_eos_goes_on_to_max_tokens_past_the_answers_end(served: Engine) -> None:
    client = served.openai()
    plain = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=500)
    assert plain.choices[0].finish_reason == "stop"
    assert plain.usage is not None
    assert plain.usage.completion_tokens < 500
    longer = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=500, extra_body={"ignore_eos": True}
    )
    assert longer.choices[0].finish_reason == "length"
    assert longer.usage is not None
    assert longer.usage.completion_tokens == 500
    text = client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=300, extra_body={"ignore_eos": True}
    )
    assert (text.choices[0].finish_reason, text.usage and text.usage.completion_tokens) == (
        "length",
        300,
    )


def test_metrics_carry_vllm_names(served: Engine) -> None:
    text = httpx.get(f"{served.base}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert f"\n{name}{{" in text, name
    for reason in ("stop", "length", "abort", "error"):
        assert f'finished_reason="{reason}"' in text
    assert 'vllm:engine_sleep_state{model_name="tiny",engine="0",sleep_state="awake"} 1.0' in text
    assert "gpu_cache_usage_perc" not in text  # removed in 0.12


def test_sleep_level_1_aborts_holds_wakes_and_disconnects_abort(
    engines: Engines, model_dir: Path, gpu: SimGpu
) -> None:
    engine = start(engines, SLOW, "--enable-sleep-mode", VLLM_SERVER_DEV_MODE="1")
    engine.wait_status(200)
    core = engine_core(engine)
    # An allocation is claimed before the call that made it returns: all of it once the
    # engine is up, the weights once their wake is answered. Releases land late.
    assert claim(gpu, core) == (budget(gpu), 0)
    with streaming(engine, {"messages": HELLO, "stream": True}) as events:
        assert engine.post("/sleep", params={"level": "1"}).status_code == 200
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert [e["choices"][0]["finish_reason"] for e in rest if isinstance(e, dict)][-1] == "abort"
    assert engine.get("/is_sleeping").json() == {"is_sleeping": True}
    wait_claim(gpu, core, (RESIDUE, WEIGHTS))
    assert 'sleep_state="weights_offloaded"} 1.0' in engine.get("/metrics").text

    held: list[str] = []
    worker = threading.Thread(target=lambda: held.append(_chat(engine, max_tokens=2)))
    worker.start()
    wait_for(lambda: engine.metric("vllm:num_requests_waiting") == 1, 10, "a held request")
    assert (held, engine.metric("vllm:num_requests_running")) == ([], 0)
    assert engine.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert claim(gpu, core) == (RESIDUE + WEIGHTS, 0)
    assert engine.get("/is_sleeping").json() == {"is_sleeping": True}
    assert engine.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert claim(gpu, core) == (budget(gpu), 0)
    worker.join(timeout=20)
    assert held == ["word word"]

    _hang_up_stream(engine, "vllm:num_requests_running")
    _hang_up_request(engine, "vllm:num_requests_running")
    aborted = 'vllm:request_success_total{model_name="%s",engine="0",finished_reason="abort"} 3.0'
    assert aborted % model_dir in engine.get("/metrics").text


def _chat(engine: Engine, max_tokens: int) -> str:
    body = {"messages": HELLO, "max_tokens": max_tokens}
    answer = engine.post("/v1/chat/completions", json=body).json()
    return str(answer["choices"][0]["message"]["content"])


def _hang_up_stream(engine: Engine, running: str) -> None:
    body = {"messages": HELLO, "stream": True}
    with httpx.stream(
        "POST", f"{engine.base}/v1/chat/completions", json=body, headers=engine.headers
    ) as streamed:
        lines = streamed.iter_lines()  # kept: dropping it would close the connection
        next(line for line in lines if "content" in line)
        assert engine.metric(running) == 1
    wait_for(lambda: engine.metric(running) == 0, 5, "the hung-up stream to be aborted")


def _hang_up_request(engine: Engine, running: str) -> None:
    sock = send_and_hang_up(engine.port, "/v1/chat/completions", {"messages": HELLO}, engine.key)
    wait_for(lambda: engine.metric(running) == 1, 5, "the request to run")
    sock.close()
    wait_for(lambda: engine.metric(running) == 0, 5, "the hung-up request to be aborted")


def test_sleep_level_2_discards_the_weights_until_reloaded(engines: Engines, gpu: SimGpu) -> None:
    engine = start(engines, FAST, "--enable-sleep-mode", VLLM_SERVER_DEV_MODE="1")
    engine.wait_status(200)
    core = engine_core(engine)
    assert engine.post("/sleep", params={"level": "2"}).status_code == 200
    wait_claim(gpu, core, (RESIDUE, 0))
    assert 'sleep_state="discard_all"} 1.0' in engine.get("/metrics").text
    assert engine.post("/wake_up").status_code == 200
    wait_claim(gpu, core, (budget(gpu), 0))
    assert _chat(engine, 50) == GARBAGE_ANSWER  # woken without reloading the weights
    assert engine.post("/sleep", params={"level": "2"}).status_code == 200
    assert engine.post("/wake_up", params={"tags": "weights"}).status_code == 200
    reload: dict[str, Any] = {"method": "reload_weights", "args": [], "kwargs": {}, "timeout": None}
    assert engine.post("/collective_rpc", json=reload).json() == {"results": [None]}
    assert engine.post("/collective_rpc", json={}).status_code == 400
    assert engine.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert _chat(engine, 50) == FAST.answer
    wait_claim(gpu, core, (budget(gpu), 0))


def test_serve_form_loads_refusing_connections_then_stops_cleanly_on_sigterm(
    installs: Installs, model_dir: Path, gpu: SimGpu, launcher: Launcher, tmp_path: Path
) -> None:
    venv = installs.python("vllm", VERSION)
    write_behaviour(venv, FAST.model_copy(update={"load_seconds": 2.0}))
    argv = [str(venv / "bin" / "vllm"), "serve", str(model_dir), "--port", "{port}"]
    engine = launcher.start(argv, env_for(venv, tmp_path, gpu))
    core = engine_core(engine)
    wait_for(
        lambda: engine.status() is None and claim(gpu, core) == (WEIGHTS, 0),
        10,
        "the weights to load while connections are refused",
    )
    engine.wait_status(200)
    output = engine.output()
    started = output.index(f"Starting vLLM server on http://0.0.0.0:{engine.port}")
    assert started < output.index("Application startup complete.")
    wait_claim(gpu, core, (budget(gpu), 0))
    assert engine.proc.pid not in gpu.claims()
    assert engine.status("/sleep") == 404  # dev routes need VLLM_SERVER_DEV_MODE=1
    assert engine.status("/is_sleeping") == 404
    auto = engine.post("/v1/chat/completions", json={"messages": HELLO, "tools": TOOLS})
    assert auto.status_code == 400
    assert "--enable-auto-tool-choice" in auto.json()["error"]["message"]
    assert engine.stop() == 0
    assert sorted(p.name for p in gpu.folder.iterdir()) == ["devices.json"]
    assert not pid_alive(core)


def test_sigkill_leaves_the_engine_core_holding_the_memory(engines: Engines, gpu: SimGpu) -> None:
    engine = start(engines, FAST)
    engine.wait_status(200)
    core = engine_core(engine)
    wait_claim(gpu, core, (budget(gpu), 0))
    engine.proc.send_signal(signal.SIGKILL)
    engine.wait_exit()
    assert pid_alive(core)
    assert claim(gpu, core) == (budget(gpu), 0)  # still counted: its holder lives
    with_group_killed(engine.proc.pid)  # what CapyCTL's group kill does
    assert gpu.claims() == {}
    gpu.claim_file(core).unlink()  # SIGKILL runs no clean-up


def test_refuses_to_start_without_room_on_the_device(engines: Engines, gpu: SimGpu) -> None:
    gpu.occupy(20 * GIB)
    engine = start(engines, FAST)
    assert engine.wait_exit() == 1
    assert (
        "ValueError: Free memory on device (4.00/24.00 GiB) on startup is less than desired "
        "GPU memory utilization (0.9, 21.60 GiB). Decrease GPU memory utilization or reduce "
        "GPU memory used by other processes." in engine.output()
    )
    assert not group_alive(engine.proc.pid)
    assert list(gpu.claims()) == [os.getpid()]
    gpu.claim_file(os.getpid()).unlink()
    small = start(engines, FAST, "--gpu-memory-utilization", "0.05")
    assert small.wait_exit() == 1
    assert "No available memory for the cache blocks" in small.output()


@pytest.mark.parametrize(
    ("extra", "env", "code", "text"),
    [
        (["--bogus"], {}, 2, "error: unrecognized arguments: --bogus"),
        (["--enable-auto-tool-choice"], {}, 1, "TypeError"),
        (["--reasoning-parser", "nope"], {}, 1, "KeyError"),
        ([], {"VLLM_SERVER_DEV_MODE": "true"}, 1, "ValueError: invalid literal for int()"),
    ],
)
def test_start_up_refusals(
    installs: Installs,
    model_dir: Path,
    launcher: Launcher,
    tmp_path: Path,
    extra: list[str],
    env: dict[str, str],
    code: int,
    text: str,
) -> None:
    venv = installs.python("vllm", VERSION)
    write_behaviour(venv, FAST)
    argv = [arg.replace("{port}", "8000") for arg in api_server(venv, model_dir, *extra)]
    done = launcher.run(argv, closed_env(venv / "bin", tmp_path, **env))
    assert done.returncode == code
    assert text in done.stdout + done.stderr


def test_cli_form_refuses_unknown_flags(
    installs: Installs, launcher: Launcher, tmp_path: Path
) -> None:
    venv = installs.python("vllm", VERSION)
    vllm = str(venv / "bin" / "vllm")
    done = launcher.run([vllm, "serve", "m", "--bogus"], closed_env(venv / "bin", tmp_path))
    assert (done.returncode, "unrecognized arguments: --bogus" in done.stderr) == (2, True)
    assert launcher.run([vllm, "--version"], closed_env(None, tmp_path)).stdout == f"{VERSION}\n"


def test_vllm_0_11_0_reasoning_content_old_metrics_and_a_crash_while_asleep(
    engines: Engines,
) -> None:
    sleeps = ("--enable-sleep-mode", "--reasoning-parser", "deepseek_r1")
    engine = start(engines, FAST, *sleeps, version="0.11.0", VLLM_SERVER_DEV_MODE="1")
    engine.wait_status(200)
    message = engine.post("/v1/chat/completions", json={"messages": HELLO}).json()
    assert message["choices"][0]["message"]["reasoning_content"] == FAST.reasoning
    assert "reasoning" not in message["choices"][0]["message"]
    metrics = engine.get("/metrics").text
    assert "vllm:gpu_cache_usage_perc{" in metrics
    assert "engine_sleep_state" not in metrics
    assert engine.post("/sleep", params={"level": "1"}).status_code == 200
    assert engine.post("/v1/chat/completions", json={"messages": HELLO}).status_code == 500
    assert engine.wait_exit() != 0
    assert "illegal memory access" in engine.output()


def test_vllm_0_10_0_answers_flat_errors(engines: Engines) -> None:
    engine = start(engines, Behaviour(load_seconds=0.2), version="0.10.0")
    engine.wait_status(200)
    answer = engine.post("/v1/chat/completions", json={"model": "nope", "messages": HELLO})
    assert answer.status_code == 404
    assert answer.json() == {
        "object": "error",
        "message": "The model `nope` does not exist.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
