"""The simulated SGLang, launched from a real install: phases, API, release/resume, signals."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engines.simulator.helpers import (
    FAST,
    GIB,
    HELLO,
    KEY,
    MIB,
    SLOW,
    TALKATIVE,
    TOOLS,
    Engine,
    Engines,
    Servers,
    SimGpu,
    claim,
    env_for,
    python_argv,
    send_and_hang_up,
    streaming,
    wait_claim,
)
from enginesim import Behaviour, DisconnectLag, Faults, write_behaviour
from enginesim.behaviour import GARBAGE_ANSWER
from support import wait_for

VERSION = "0.5.10"
WEIGHTS = 2 * GIB
RESIDUE = 512 * MIB
GRAPHS = 256 * MIB


def start(engines: Engines, behaviour: Behaviour, *extra: str, version: str = VERSION) -> Engine:
    """SGLang launched and serving."""
    engine = engines.start("sglang", version, behaviour, *extra)
    engine.wait_status(200)
    return engine


def budget(gpu: SimGpu) -> int:
    return int(0.88 * gpu.total)


def segment(pid: int) -> Path:
    return Path("/dev/shm") / f"multi_tokenizer_args_{pid}"


@pytest.fixture(scope="module")
def served(servers: Servers) -> Iterator[Engine]:
    flags = [
        "--served-model-name",
        "tiny",
        "--enable-metrics",
        "--tool-call-parser",
        "qwen25",
        "--reasoning-parser",
        "qwen3",
        "--skip-server-warmup",
    ]
    with servers.python("sglang-served", "sglang", VERSION, TALKATIVE, *flags) as engine:
        yield engine


def test_auth_guards_everything_but_health_and_metrics(served: Engine) -> None:
    for path in ("/v1/models", "/model_info", "/server_info", "/get_load"):
        bare = httpx.get(served.base + path)
        assert (bare.status_code, bare.json()) == (401, {"error": "Unauthorized"}), path
    for path in ("/health", "/health_generate", "/metrics"):
        assert httpx.get(served.base + path).status_code == 200, path
    card = served.get("/v1/models").json()["data"][0]
    assert (card["id"], card["owned_by"], card["root"], card["max_model_len"]) == (
        "tiny",
        "sglang",
        "tiny",
        4096,
    )


def test_info_routes_and_their_deprecated_aliases(served: Engine, model_dir: Path) -> None:
    for path in ("/model_info", "/get_model_info"):
        assert served.get(path).json()["model_path"] == str(model_dir)
    for path in ("/server_info", "/get_server_info"):
        info = served.get(path).json()
        assert (info["version"], info["api_key"], info["served_model_name"]) == (
            VERSION,
            KEY,
            "tiny",
        )
    assert served.get("/v1/models/tiny").status_code == 200
    missing = served.get("/v1/models/nope")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")


def test_chat_takes_its_id_from_rid_and_reasons_in_reasoning_content(served: Engine) -> None:
    completion = served.openai().chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=5, extra_body={"rid": "my-rid"}
    )
    assert completion.id == "my-rid"
    message = completion.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == "Thinking it over."
    assert message.content == "Hello from"
    assert completion.choices[0].finish_reason == "length"
    header_id = served.post(
        "/v1/chat/completions",
        json={"messages": HELLO, "max_tokens": 1},
        headers={"X-Request-Id": "ignored"},
    )
    assert re.fullmatch(r"[0-9a-f]{32}", header_id.json()["id"])


def test_stream_with_usage_tools_and_reasoning(served: Engine) -> None:
    client = served.openai()
    stream = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == "Thinking it over."
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert calls[0].function is not None
    assert calls[0].function.name == "get_weather"
    assert calls[0].id is not None
    assert calls[0].id.startswith("call_")
    arguments = "".join(c.function.arguments or "" for c in calls[1:] if c.function)
    assert json.loads(arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None


def test_flat_errors_and_json_only(served: Engine) -> None:
    text = served.post(
        "/v1/chat/completions",
        content=json.dumps({"messages": HELLO}),
        headers={"Content-Type": "text/plain"},
    )
    assert text.status_code == 400
    assert text.json()["object"] == "error"
    assert text.json()["code"] == 400
    invalid = served.post("/v1/chat/completions", json={"messages": "not a list"})
    assert (invalid.status_code, invalid.json()["type"]) == (400, "BadRequest")


def test_abort_by_rid_flush_when_busy_and_metrics(served: Engine) -> None:
    # The answer goes on (ignore_eos) until the abort: on a loaded machine a short one could
    # end before the flush is tried.
    body = {"messages": HELLO, "stream": True, "rid": "abort-me", "ignore_eos": True}
    body["max_tokens"] = 100_000
    with streaming(served, body) as events:
        assert served.metric("sglang:num_running_reqs") == 1
        assert served.post("/flush_cache").status_code == 400
        assert served.post("/abort_request", json={"rid": "nobody"}).status_code == 200
        assert served.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
        rest = list(events)
    finishes = [e["choices"][0]["finish_reason"] for e in rest if isinstance(e, dict)]
    assert finishes[-1] == "abort"
    assert rest[-1] == "[DONE]"
    assert served.post("/flush_cache").status_code == 200
    text = httpx.get(f"{served.base}/metrics").text
    for name in (
        "num_running_reqs",
        "num_queue_reqs",
        "token_usage",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_requests_total",
    ):
        assert f'\nsglang:{name}{{model_name="tiny"}}' in text, name
    assert 'sglang:num_aborted_requests_total{model_name="tiny"} 1.0' in text


def test_aborts_count_only_requests_the_engine_holds(served: Engine) -> None:
    """The per-request state SGLang keeps: an abort of a rid it does not hold (never came, or
    already finished) is dropped uncounted; one it holds is counted, and repeats are counted
    until the request's end comes back."""
    aborted = "sglang:num_aborted_requests_total"
    start = served.metric(aborted)
    assert served.post("/abort_request", json={"rid": "never-came"}).status_code == 200
    assert served.metric(aborted) == start
    body = {"messages": HELLO, "stream": True, "rid": "held-1"}
    with streaming(served, body) as events:
        assert served.post("/abort_request", json={"rid": "held-1"}).content == b""
        assert served.metric(aborted) == start + 1
        list(events)

    def gone() -> bool:
        before = served.metric(aborted)
        served.post("/abort_request", json={"rid": "held-1"})
        return served.metric(aborted) == before

    wait_for(gone, 5, "the aborted request to leave the engine's state")
    finished = served.post("/v1/chat/completions", json={"messages": HELLO, "rid": "done-1"})
    assert finished.json()["id"] == "done-1"
    wait_for(gone, 5, "a finished request to leave the engine's state")


def test_phases_serve_form_and_metrics_off_by_default(engines: Engines, gpu: SimGpu) -> None:
    venv = engines.installs.python("sglang", VERSION)
    write_behaviour(venv, FAST.model_copy(update={"load_seconds": 1.5, "warmup_seconds": 1.5}))
    sglang = str(venv / "bin" / "sglang")
    argv = [sglang, "serve", "--model-path", str(engines.model), "--port", "{port}"]
    engine = engines.launcher.start(argv, env_for(venv, engines.home, gpu))
    wait_for(
        lambda: engine.status() is None and claim(gpu, engine.proc.pid) == (WEIGHTS, 0),
        10,
        "the weights to load while connections are refused",
    )
    engine.wait_status(503)
    assert "fired up" not in engine.output()
    engine.wait_status(200)
    assert "The server is fired up and ready to roll!" in engine.output()
    wait_claim(gpu, engine.proc.pid, (budget(gpu), 0))
    assert engine.status("/metrics") == 404
    assert engine.stop() == 0


def test_release_and_resume_by_tags(engines: Engines, gpu: SimGpu) -> None:
    saver = ("--enable-memory-saver", "--enable-weights-cpu-backup", "--skip-server-warmup")
    engine = start(engines, FAST, *saver)
    pid = engine.proc.pid
    kv = budget(gpu) - WEIGHTS - GRAPHS
    released = engine.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert (released.status_code, released.json()) == (200, None)
    wait_claim(gpu, pid, (RESIDUE + WEIGHTS + GRAPHS, 0))
    not_released = engine.post("/resume_memory_occupation", json={"tags": ["weights"]})
    assert not_released.status_code == 500
    assert "KeyError" in not_released.json()["error"]["message"]
    assert engine.post("/release_memory_occupation", json={}).status_code == 200
    wait_claim(gpu, pid, (RESIDUE, WEIGHTS))  # the weights backed up in host RAM
    assert engine.post("/resume_memory_occupation", json={}).status_code == 200
    wait_claim(gpu, pid, (WEIGHTS + kv + GRAPHS, 0))
    answer = engine.post("/v1/chat/completions", json={"messages": HELLO}).json()
    assert answer["choices"][0]["message"]["content"] == FAST.answer


def test_release_without_backup_needs_a_weight_reload(
    engines: Engines, model_dir: Path, gpu: SimGpu
) -> None:
    engine = start(engines, FAST, "--enable-memory-saver", "--skip-server-warmup")
    assert engine.post("/release_memory_occupation").status_code == 200
    wait_claim(gpu, engine.proc.pid, (RESIDUE, 0))
    assert engine.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    reload = engine.post("/update_weights_from_disk", json={"model_path": str(model_dir)})
    assert reload.json()["success"] is True
    rest = {"tags": ["kv_cache", "cuda_graph"]}
    assert engine.post("/resume_memory_occupation", json=rest).status_code == 200
    answer = engine.post("/v1/chat/completions", json={"messages": HELLO}).json()
    assert answer["choices"][0]["message"]["content"] == FAST.answer
    assert engine.post("/release_memory_occupation").status_code == 200
    assert engine.post("/resume_memory_occupation").status_code == 200
    garbage = engine.post("/v1/chat/completions", json={"messages": HELLO}).json()
    assert garbage["choices"][0]["message"]["content"] == GARBAGE_ANSWER


def test_release_while_busy_kills_the_scheduler(engines: Engines) -> None:
    engine = start(engines, SLOW, "--enable-memory-saver", "--skip-server-warmup")
    sock = send_and_hang_up(engine.port, "/v1/chat/completions", {"messages": HELLO}, None)
    wait_for(lambda: engine.get("/get_load").json()[0]["num_reqs"] == 1, 5, "a running request")
    with pytest.raises(httpx.TransportError):
        engine.post("/release_memory_occupation")
    sock.close()
    assert engine.wait_exit() != 0
    assert "release_memory_occupation should be called only when no ongoing request" in (
        engine.output()
    )


def test_hang_ups_abort_after_sglang_lag(engines: Engines) -> None:
    # Lags long enough that the first reading lands within them on a loaded machine.
    lag = DisconnectLag(non_stream=3.0, stream=3.0)
    lagging = SLOW.model_copy(update={"faults": Faults(disconnect_abort_lag=lag)})
    engine = start(engines, lagging, "--enable-metrics", "--skip-server-warmup")
    running = "sglang:num_running_reqs"
    body = {"messages": HELLO, "stream": True}
    with httpx.stream("POST", f"{engine.base}/v1/chat/completions", json=body) as streamed:
        lines = streamed.iter_lines()
        next(line for line in lines if "content" in line)
    assert engine.metric(running) == 1  # still running: SGLang notices late
    wait_for(lambda: engine.metric(running) == 0, 15, "the stream's late abort")
    sock = send_and_hang_up(engine.port, "/v1/chat/completions", {"messages": HELLO}, None)
    wait_for(lambda: engine.metric(running) == 1, 15, "the request to run")
    sock.close()
    assert engine.metric(running) == 1  # still running: SGLang notices late
    wait_for(lambda: engine.metric(running) == 0, 15, "the request's late abort")
    assert engine.metric("sglang:num_aborted_requests_total") == 2


def test_sigterm_cleans_the_segment_and_memory_sigkill_leaves_the_segment(
    engines: Engines, gpu: SimGpu
) -> None:
    workers = ("--tokenizer-worker-num", "2", "--skip-server-warmup")
    first = start(engines, FAST, *workers)
    assert segment(first.proc.pid).exists()
    assert first.stop() == 0
    assert not segment(first.proc.pid).exists()
    assert sorted(p.name for p in gpu.folder.iterdir()) == ["devices.json"]
    second = start(engines, FAST, *workers)
    second.proc.send_signal(signal.SIGKILL)
    second.wait_exit()
    try:
        assert segment(second.proc.pid).exists()
        assert gpu.claims() == {}  # a dead pid's claim no longer counts
    finally:
        segment(second.proc.pid).unlink(missing_ok=True)


def test_refusals_at_start(engines: Engines, gpu: SimGpu) -> None:
    venv = engines.installs.python("sglang", VERSION)
    write_behaviour(venv, FAST)
    argv = python_argv("sglang", venv, engines.model, "--bogus")
    bogus = engines.launcher.run([a.replace("{port}", "30000") for a in argv], engines.closed_env())
    assert (bogus.returncode, "unrecognized arguments: --bogus" in bogus.stderr) == (2, True)
    # 0.88 of the 2 GiB left free is less than the 2 GiB of weights: no room for a KV cache.
    gpu.occupy(22 * GIB)
    full = engines.start("sglang", VERSION, FAST)
    assert full.wait_exit() != 0
    assert (
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."
        in full.output()
    )


def test_its_static_memory_is_a_share_of_what_is_free_when_it_starts(
    engines: Engines, gpu: SimGpu
) -> None:
    # As SGLang's profile_max_num_token: --mem-fraction-static of the memory free at its
    # start (12 GiB of the 24 here), not of the card, holds its weights and KV cache.
    gpu.occupy(12 * GIB)
    engine = start(engines, FAST, "--mem-fraction-static", "0.5")
    wait_claim(gpu, engine.proc.pid, (6 * GIB, 0))
    assert engine.stop() == 0


def test_v1_loads_takes_its_own_shape_from_0_5_20(engines: Engines, served: Engine) -> None:
    assert isinstance(served.get("/v1/loads").json(), list), "0.5.10: the /get_load list"
    engine = start(engines, FAST, "--skip-server-warmup", version="0.5.22")
    loads = engine.get("/v1/loads").json()
    assert loads["version"] == "0.5.22"
    assert {"timestamp", "accelerator", "num_accelerators"} <= set(loads)
    (rank,) = loads["loads"]
    assert (rank["dp_rank"], rank["num_running_reqs"], rank["num_waiting_reqs"]) == (0, 0, 0)
    assert engine.get("/get_load").json()[0]["num_reqs"] == 0, "/get_load keeps its list"
