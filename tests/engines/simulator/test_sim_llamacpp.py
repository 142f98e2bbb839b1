"""The simulated llama-server: loading, auth, slots and deferral, metrics, idle sleep, flags."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.simulator.helpers import (
    FAST,
    GIB,
    HELLO,
    KEY,
    MIB,
    TALKATIVE,
    TOOLS,
    Engine,
    Engines,
    Servers,
    SimGpu,
    sse_events,
    wait_claim,
)
from support import wait_for

BUILD = 6500
KV = 4096 * (128 << 10) + 1 * (8 << 20)  # -c 4096, -np 1
RESIDUE = 512 * MIB
LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


@pytest.fixture(scope="module")
def served(servers: Servers) -> Iterator[Engine]:
    extra = ("-np", "1", "-c", "4096", "--metrics", "--alias", "tiny")
    with servers.llama("llama-served", BUILD, TALKATIVE, *extra) as engine:
        yield engine


def test_auth_leaves_health_and_models_public(served: Engine) -> None:
    for path in ("/health", "/v1/health", "/models", "/v1/models"):
        assert httpx.get(served.base + path).status_code == 200, path
    for path in ("/props", "/slots", "/metrics"):
        refused = httpx.get(served.base + path)
        assert refused.status_code == 401, path
        assert refused.json() == {
            "error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}
        }
    assert httpx.get(f"{served.base}/props", headers={"x-api-key": KEY}).status_code == 200


def test_models_and_props(served: Engine, gguf: Path) -> None:
    card = httpx.get(f"{served.base}/v1/models").json()["data"][0]
    assert (card["id"], card["owned_by"], card["meta"]["size"]) == ("tiny", "llamacpp", GIB)
    props = served.get("/props").json()
    assert (props["total_slots"], props["is_sleeping"]) == (1, False)
    assert props["model_path"] == str(gguf)
    assert re.fullmatch(r"b6500-[0-9a-f]{8}", props["build_info"])


def test_chat_with_reasoning_content_and_timings(served: Engine) -> None:
    completion = served.openai().chat.completions.create(model="tiny", messages=HELLO, max_tokens=5)
    assert re.fullmatch(r"chatcmpl-[A-Za-z0-9]{32}", completion.id)
    message = completion.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == "Thinking it over."
    assert message.content == "Hello from"
    assert "timings" in (completion.model_extra or {})
    body = {
        "messages": HELLO,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", f"{served.base}/v1/chat/completions", json=body, headers=served.headers
    ) as streamed:
        events = list(sse_events(streamed.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert all("timings" in chunk for chunk in chunks)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_tool_calls(served: Engine) -> None:
    completion = served.openai().chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS)
    assert completion.choices[0].finish_reason == "tool_calls"
    calls: Any = completion.choices[0].message.tool_calls
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}


def test_requests_beyond_the_slots_are_deferred_and_hang_ups_free_the_slot(
    served: Engine,
) -> None:
    # The first answer goes on until it is hung up on (ignore_eos, as llama-server takes it), so
    # the slot stays taken however late the second request comes on a loaded machine.
    body = {"messages": HELLO, "stream": True, "max_tokens": 4000, "ignore_eos": True}
    later: list[str] = []
    with httpx.stream(
        "POST", f"{served.base}/v1/chat/completions", json=body, headers=served.headers
    ) as streamed:
        lines = streamed.iter_lines()  # kept: dropping it would close the connection
        next(line for line in lines if "content" in line)
        second = threading.Thread(target=lambda: later.append(_chat(served, 2)))
        second.start()
        wait_for(lambda: served.metric("llamacpp:requests_deferred") == 1, 30, "a deferral")
        assert served.metric("llamacpp:requests_processing") == 1
        assert served.get("/slots").json()[0]["is_processing"] is True
        assert served.get("/slots", params={"fail_on_no_slot": "1"}).status_code == 503
    second.join(timeout=30)
    assert later == ["Thinking it"]
    wait_for(lambda: served.metric("llamacpp:requests_processing") == 0, 30, "a free slot")
    text = served.get("/metrics").text
    for name in (
        "prompt_tokens_total",
        "tokens_predicted_total",
        "requests_processing",
        "requests_deferred",
        "n_decode_total",
    ):
        assert f"\nllamacpp:{name} " in text, name
    assert "kv_cache" not in text


def _chat(engine: Engine, max_tokens: int) -> str:
    answer = engine.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": max_tokens})
    return str(answer.json()["choices"][0]["message"]["reasoning_content"])


def test_listens_at_once_loads_then_serves_and_stops_cleanly(
    engines: Engines, gguf: Path, gpu: SimGpu
) -> None:
    # A load long enough that a loaded machine still asks both questions while it runs.
    slow_load = FAST.model_copy(update={"load_seconds": 6})
    engine = engines.start_llama(BUILD, slow_load, gguf, "--no-slots")
    engine.wait_status(503)
    loading = httpx.get(f"{engine.base}/health")
    assert loading.json() == LOADING
    assert httpx.get(f"{engine.base}/v1/models").json()["data"][0]["meta"] is None
    engine.wait_status(200)
    assert httpx.get(f"{engine.base}/health").json() == {"status": "ok"}
    wait_claim(gpu, engine.proc.pid, (GIB + 4096 * (128 << 10) + 4 * (8 << 20), 0))
    assert engine.status("/slots") == 501
    assert engine.get("/metrics").json()["error"]["type"] == "not_supported_error"
    assert engine.stop() == 0
    assert sorted(p.name for p in gpu.folder.iterdir()) == ["devices.json"]


def test_idle_sleep_frees_memory_and_the_next_request_reloads(
    engines: Engines, gguf: Path, gpu: SimGpu
) -> None:
    engine = engines.start_llama(BUILD, FAST, gguf, "-np", "1", "--sleep-idle-seconds", "1")
    engine.wait_status(200)
    pid = engine.proc.pid
    wait_claim(gpu, pid, (GIB + KV, 0))
    # Polling /health and /props neither wakes it nor keeps it awake.
    wait_for(
        lambda: engine.status() == 200 and engine.get("/props").json()["is_sleeping"],
        10,
        "idle sleep",
    )
    wait_claim(gpu, pid, (RESIDUE, 0))
    answer = engine.post("/v1/chat/completions", json={"messages": HELLO}).json()
    assert answer["choices"][0]["message"]["content"] == FAST.answer
    assert engine.get("/props").json()["is_sleeping"] is False
    wait_claim(gpu, pid, (GIB + KV, 0))


def test_version_and_unknown_flags(engines: Engines) -> None:
    executable, launcher = str(engines.installs.llama(BUILD)), engines.launcher
    version = launcher.run([executable, "--version"], engines.closed_env())
    assert version.returncode == 0
    assert re.match(r"version: 6500 \([0-9a-f]{8}\)\nbuilt with .+ for x86_64", version.stderr)
    bogus = launcher.run([executable, "--bogus"], engines.closed_env())
    assert (bogus.returncode, bogus.stderr) == (1, "error: invalid argument: --bogus\n")


@pytest.mark.parametrize(("build", "port", "notice"), [(6850, 8080, True), (6900, 9931, False)])
def test_default_port_by_build(
    engines: Engines, gguf: Path, build: int, port: int, notice: bool
) -> None:
    argv = [str(engines.installs.llama(build)), "-m", str(gguf)]
    engine = engines.launcher.start(argv, engines.closed_env())
    said = re.compile(rf"(listening on http://127\.0\.0\.1:{port} |port: {port}$)", re.M)
    wait_for(lambda: said.search(engine.output()), 10, f"the server on port {port}")
    assert ("NOTICE: server default port will be changed to :9931" in engine.output()) is notice


def test_out_of_memory_and_missing_model_exit_1(
    engines: Engines, gguf: Path, gpu: SimGpu, tmp_path: Path
) -> None:
    gpu.occupy(23 * GIB)
    full = engines.start_llama(BUILD, FAST, gguf)
    assert full.wait_exit() == 1
    assert "cudaMalloc failed: out of memory" in full.output()
    assert "main: exiting due to model loading error" in full.output()
    missing = engines.start_llama(BUILD, FAST, tmp_path / "none.gguf")
    assert missing.wait_exit() == 1
    assert "exiting due to model loading error" in missing.output()
