"""The behaviour's faults: hangs, deaths, lying sleeps, garbage after a wake, leaks."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from engines.simulator.helpers import (
    FAST,
    HELLO,
    SLOW,
    Engine,
    Engines,
    SimGpu,
    engine_core,
    send_and_hang_up,
    sse_events,
    wait_group_ended,
)
from enginesim import Behaviour, CrashAtStart, Faults, SchedulerDies
from enginesim.behaviour import GARBAGE_ANSWER
from support import wait_for

SHM = Path("/dev/shm")


def with_faults(behaviour: Behaviour, faults: Faults) -> Behaviour:
    return behaviour.model_copy(update={"faults": faults})


def start_vllm(engines: Engines, faults: Faults, *extra: str, **env: str) -> Engine:
    """vLLM 0.17.0 with `faults`, launched (it may still be loading)."""
    return engines.start("vllm", "0.17.0", with_faults(FAST, faults), *extra, **env)


def start_sglang(
    engines: Engines,
    version: str,
    behaviour: Behaviour,
    *extra: str,
    key: str | None = None,
    **env: str,
) -> Engine:
    """SGLang without its warm-up, launched (it may still be loading)."""
    warm_up = "--skip-server-warmup"
    return engines.start("sglang", version, behaviour, warm_up, *extra, key=key, **env)


def test_vllm_hang_keeps_health_and_shutdown_timeout_bounds_the_drain(engines: Engines) -> None:
    engine = start_vllm(engines, Faults(hang=True), "--shutdown-timeout", "1")
    engine.wait_status(200)
    sock = send_and_hang_up(engine.port, "/v1/chat/completions", {"messages": HELLO}, None)
    wait_for(lambda: engine.metric("vllm:num_requests_running") == 1, 5, "a running request")
    for path in ("/health", "/version", "/v1/models"):
        assert engine.status(path) == 200, path
    assert engine.metric("vllm:generation_tokens_total") == 0
    assert engine.stop() == 0  # the drain gives up after --shutdown-timeout
    sock.close()


def test_vllm_lying_sleep_garbage_after_wake_and_death_mid_stream(
    engines: Engines, gpu: SimGpu
) -> None:
    faults = Faults(sleep_keeps_memory=True, garbage_after_wake=True, die_mid_stream=6)
    engine = start_vllm(engines, faults, "--enable-sleep-mode", VLLM_SERVER_DEV_MODE="1")
    engine.wait_status(200)
    core = engine_core(engine, timeout=5)
    full = int(0.9 * gpu.total)
    wait_for(lambda: core in gpu.claims() and gpu.claims()[core].bytes == full, 5, "the claim")
    written = gpu.claim_file(core).stat().st_mtime_ns
    assert engine.post("/sleep", params={"level": "1"}).status_code == 200
    assert engine.get("/is_sleeping").json() == {"is_sleeping": True}
    wait_for(lambda: gpu.claim_file(core).stat().st_mtime_ns != written, 5, "the claim rewritten")
    assert gpu.claims()[core].bytes == full  # it said it slept; the memory stayed
    assert engine.post("/wake_up").status_code == 200
    answer = engine.post("/v1/chat/completions", json={"messages": HELLO}).json()
    assert answer["choices"][0]["message"]["content"] == GARBAGE_ANSWER  # 4 tokens so far
    body = {"messages": HELLO, "stream": True}
    with httpx.stream("POST", f"{engine.base}/v1/chat/completions", json=body) as streamed:
        events = list(sse_events(streamed.iter_lines()))
    chunks = [e for e in events[1:-2] if isinstance(e, dict)]
    contents = [chunk["choices"][0]["delta"].get("content") for chunk in chunks]
    assert contents == ["!!!!!!!!", " !!!!!!!!"]  # tokens 5 and 6, then the engine died
    assert events[-2] == {
        "error": {
            "message": "EngineCore encountered an issue. See stack trace for the root cause.",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    assert events[-1] == "[DONE]"
    assert engine.wait_exit() != 0
    assert "EngineDeadError" in engine.output()


def test_sglang_busy_release_as_an_error_requests_while_released_fail_admin_key(
    engines: Engines,
) -> None:
    faults = Faults(release_while_busy="error", generate_while_released="error")
    argv = ("--enable-memory-saver", "--api-key", "user", "--admin-api-key", "admin")
    engine = start_sglang(engines, "0.5.10", with_faults(SLOW, faults), *argv, key="admin")
    engine.wait_status(200)
    user = {"Authorization": "Bearer user"}
    sock = send_and_hang_up(engine.port, "/v1/chat/completions", {"messages": HELLO}, "user")
    wait_for(
        lambda: engine.get("/get_load", headers=user).json()[0]["num_reqs"] == 1, 5, "a request"
    )
    assert engine.post("/release_memory_occupation", headers=user).status_code == 401
    busy = engine.post("/release_memory_occupation")
    assert busy.status_code == 400
    assert "no ongoing request" in busy.json()["error"]["message"]
    assert engine.post("/abort_request", json={"abort_all": True}).status_code == 200
    sock.close()
    assert engine.post("/release_memory_occupation").status_code == 200
    refused = engine.post("/v1/chat/completions", headers=user, json={"messages": HELLO})
    assert (refused.status_code, refused.json()["object"]) == (500, "error")
    assert engine.post("/resume_memory_occupation").status_code == 200
    answer = engine.post("/v1/chat/completions", headers=user, json={"messages": HELLO})
    assert answer.status_code == 200


def test_sglang_health_generates_and_marks_a_hung_engine_unhealthy(engines: Engines) -> None:
    engine = start_sglang(
        engines,
        "0.5.10",
        with_faults(FAST, Faults(hang=True)),
        SGLANG_HEALTH_CHECK_TIMEOUT="0.5",
        SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION="false",
    )
    engine.wait_status(200)  # /health does not generate here
    assert engine.status("/health_generate") == 503


def test_llama_crash_at_start_and_a_leak_on_hang_up(engines: Engines, gguf: Path) -> None:
    flags = ("--metrics", "-np", "1")
    crash = CrashAtStart(exit_code=3, message="error: simulated crash")
    crashed = engines.start_llama(
        6500, with_faults(FAST, Faults(crash_at_start=crash)), gguf, *flags
    )
    assert crashed.wait_exit() == 3
    assert "error: simulated crash" in crashed.output()
    leak = Faults(keep_generating_on_disconnect=True)
    short = {"answer": "one two three four five six seven eight", "tokens_per_second": 10}
    leaky = FAST.model_copy(update={"faults": leak, **short})
    engine = engines.start_llama(6500, leaky, gguf, *flags, "--reasoning-format", "none")
    engine.wait_status(200)
    sock = send_and_hang_up(engine.port, "/v1/chat/completions", {"messages": HELLO}, None)
    wait_for(lambda: engine.metric("llamacpp:requests_processing") == 1, 5, "the request")
    sock.close()
    wait_for(lambda: engine.metric("llamacpp:tokens_predicted_total") == 8, 5, "all 8 tokens")
    assert engine.metric("llamacpp:requests_processing") == 0
    engine.proc.send_signal(signal.SIGTERM)
    assert engine.wait_exit() == 0


def test_vllm_engine_core_can_follow_its_parent_out(engines: Engines, gpu: SimGpu) -> None:
    engine = start_vllm(engines, Faults(leave_child_on_sigkill=False))
    engine.wait_status(200)
    core = engine_core(engine, timeout=5)
    wait_for(lambda: core in gpu.claims(), 5, "the EngineCore's claim")
    engine.proc.send_signal(signal.SIGKILL)
    engine.wait_exit()
    wait_for(lambda: not gpu.claim_file(core).exists(), 5, "the orphan to release and exit")


def _scheduler_dies(engines: Engines, **env: str) -> tuple[str, set[str], int]:
    """Launch SGLang whose scheduler dies while loading; stop its group once the server is
    seen waiting on; its log, the /dev/shm segments it left, and its PID."""
    dies = SchedulerDies(after_seconds=1.0, message="RuntimeError: CUDA error: out of memory")
    before = set(os.listdir(SHM))
    behaviour = with_faults(FAST, Faults(scheduler_dies=dies))
    engine = start_sglang(engines, "0.5.22", behaviour, "--enable-metrics", **env)
    wait_for(lambda: "Scheduler hit an exception" in engine.output(), 10, "the scheduler's death")
    assert engine.proc.poll() is None, "the HTTP server lives on"
    assert engine.status() is None, "and never listens"
    # Segments are files: a folder that appeared meanwhile is another program's (a router's
    # metrics folder, from a test running beside this one).
    left = {name for name in set(os.listdir(SHM)) - before if (SHM / name).is_file()}
    try:
        os.killpg(engine.proc.pid, signal.SIGTERM)
        wait_group_ended(engine.proc.pid)
        return engine.output(), left, engine.proc.pid
    finally:
        for name in left:
            (SHM / name).unlink(missing_ok=True)


def test_sglang_scheduler_dies_while_loading_and_leaves_its_segments_and_noise(
    engines: Engines,
) -> None:
    output, left, engine_pid = _scheduler_dies(engines)
    assert any(name.startswith("sglang_loads_") for name in left), left
    assert any(name.startswith("psm_") for name in left), left
    assert not any(str(engine_pid) in name for name in left), "no PID in their names"
    assert output.count("FileNotFoundError: [Errno 2] No such file or directory") >= 3, (
        "its children write into the Prometheus folder the server removed as it exited"
    )
    assert "ChildProcessError: [Errno 10] No child processes" in output, "Python 3.12's noise"


def test_sglang_children_write_into_a_given_prometheus_folder_that_stays(
    engines: Engines, tmp_path: Path
) -> None:
    folder = tmp_path / "prometheus"
    folder.mkdir()
    output, _, _ = _scheduler_dies(engines, PROMETHEUS_MULTIPROC_DIR=str(folder))
    assert "FileNotFoundError" not in output
    assert any(path.name.startswith("gauge_all_") for path in folder.iterdir())
