"""hostd as a real process: commands from its Redis stream, simulated engines on simulated
GPUs, and what it records."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import cast

import openai
import pytest

from capycommon.domain.commands import Park, Stop, Wake
from capycommon.domain.instances import InstanceRecord, ProcessIdentity
from enginesim.behaviour import CrashAtStart, Faults
from enginesim.install import write_behaviour
from integration.hostd.harness import (
    FAST,
    GiB,
    Hostd,
    assert_group_gone,
    assert_torn_down,
    environ,
    launch,
)
from ports import engine_ports
from support import group_members, short_dir, wait_for


@pytest.mark.parametrize("family", ["vllm", "sglang"])
@pytest.mark.parametrize("residency", ["host_backed", "deep"])
def test_launch_park_wake_stop(
    hostd: tuple[Hostd, str], model: Path, family: str, residency: str
) -> None:
    harness, gpu = hostd
    harness.send(launch("a", 1, gpu, model, profile=family, residency=residency))
    ready = harness.wait_state("a", "ready")
    assert ready.process is not None
    assert ready.fingerprint is not None
    assert ready.canary is not None
    budget = 6 * GiB  # 0.25 of 24 GiB
    wait_for(lambda: harness.device_bytes(ready)[0] == budget, timeout=5, what="the engine's claim")

    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{ready.port}/v1", api_key=harness.secret("a")
    ) as client:
        hi = [{"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(model="a", messages=hi)  # type: ignore[arg-type]
    assert reply.choices[0].message.content

    harness.send(Park(deployment="a", generation=1))
    parked = harness.wait_state("a", "parked")

    def released() -> tuple[int, int] | None:
        now = harness.device_bytes(parked)
        return now if now[0] < GiB else None

    _, host = wait_for(released, timeout=5, what="only a residue left on the device")
    if residency == "host_backed":
        assert host >= 2 * GiB, "host_backed keeps the weights in host RAM"

    harness.send(Wake(deployment="a", generation=1))
    woken = harness.wait_state("a", "ready")
    assert woken.process == ready.process, "the same engine process woke"
    wait_for(lambda: harness.device_bytes(woken)[0] == budget, timeout=5, what="memory back")

    harness.send(Stop(deployment="a", generation=1, reason="test"))
    stopped = harness.wait_state("a", "stopped")
    assert_torn_down(stopped)

    assert harness.transitions() == [
        (None, "starting"),
        ("starting", "starting"),
        ("starting", "ready"),
        ("ready", "parking"),
        ("parking", "parked"),
        ("parked", "waking"),
        ("waking", "ready"),
        ("ready", "stopping"),
        ("stopping", "stopped"),
    ]
    timed = [e for e in harness.events() if e["kind"] == "transition" and e["from_state"]]
    assert all(e["duration_s"] is not None and e["duration_s"] >= 0 for e in timed)


def test_the_engine_gets_a_closed_environment(
    hostd: tuple[Hostd, str], model: Path, installs: dict[str, Path]
) -> None:
    harness, gpu = hostd
    harness.send(launch("a", 1, gpu, model, env={"TOKENIZERS_PARALLELISM": "false"}))
    ready = harness.wait_state("a", "ready")
    assert ready.process is not None
    env = environ(ready.process.pid)
    assert env["PATH"].startswith(f"{installs['vllm']}/bin:")
    assert env["CUDA_VISIBLE_DEVICES"] == gpu
    assert env["CAPYCTL_SIMGPU_DIR"] == str(harness.simgpu_dir)
    assert env["DO_NOT_TRACK"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["VLLM_DO_NOT_TRACK"] == "1"
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    assert "CAPYCTL_REDIS_URL" not in env, "nothing of hostd's own environment leaks in"
    assert "CAPYCTL_ENGINE_PORTS" not in env
    assert os.getpgid(ready.process.pid) == ready.process.pid, "its own process group"
    assert os.getsid(ready.process.pid) == ready.process.pid, "its own session"


def test_a_host_that_allows_engine_telemetry_leaves_the_engines_own_defaults(
    hostd: tuple[Hostd, str], model: Path
) -> None:
    harness, gpu = hostd
    harness.stop()
    harness.settings["CAPYCTL_ENGINE_TELEMETRY"] = "allow"
    harness.start()
    harness.send(launch("a", 1, gpu, model))
    ready = harness.wait_state("a", "ready")
    assert ready.process is not None
    env = environ(ready.process.pid)
    assert not {"DO_NOT_TRACK", "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK"} & env.keys()
    assert (env["HF_HUB_OFFLINE"], env["HF_HUB_DISABLE_TELEMETRY"]) == ("1", "1"), "no Hub"


def test_a_foreign_process_on_a_port_is_skipped(
    redis_socket: Path, installs: dict[str, Path], model: Path
) -> None:
    # Two ports of this test process's own, below the kernel's ephemeral ones: the one after
    # an ephemeral port may be any process's.
    taken = int(engine_ports(6).split("-")[0])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        root = short_dir("hostd")
        harness = Hostd(
            root / "state", root / "home", redis_socket, engine_ports=f"{taken}-{taken + 1}"
        )
        harness.state.mkdir(mode=0o700, parents=True)
        gpu = harness.prepare({"vllm": installs["vllm"]})
        harness.start()
        try:
            harness.send(launch("a", 1, gpu, model))
            ready = harness.wait_state("a", "ready")
            assert ready.port == taken + 1
        finally:
            harness.stop()
            record = harness.record("a")
            if record and record.process:
                os.killpg(record.process.pgid, signal.SIGKILL)
            shutil.rmtree(root, ignore_errors=True)


def test_an_engine_crashing_at_start_fails_the_launch_at_once(
    hostd: tuple[Hostd, str], model: Path, installs: dict[str, Path]
) -> None:
    harness, gpu = hostd
    crash = FAST.model_copy(
        update={
            "faults": Faults(
                crash_at_start=CrashAtStart(
                    exit_code=3, message="RuntimeError: CUDA error: no kernel image"
                )
            )
        }
    )
    write_behaviour(installs["vllm"], crash)
    harness.send(launch("a", 1, gpu, model, start_deadline_s=600))
    failed = harness.wait_state("a", "failed", timeout=20)
    assert failed.error is not None
    assert "exited with code 3 while starting" in failed.error
    assert "CUDA error: no kernel image" in failed.error, "the last log lines are in the error"
    assert_group_gone(failed)
    assert harness.device_bytes(failed) == (0, 0)


def test_a_stop_of_a_starting_engine_tears_it_down_at_once(
    hostd: tuple[Hostd, str], model: Path, installs: dict[str, Path]
) -> None:
    # An engine that loads for a minute, stopped while it loads: the stop does not wait for
    # the start, as a delete of a large model stuck loading must not.
    harness, gpu = hostd
    write_behaviour(installs["vllm"], FAST.model_copy(update={"load_seconds": 60}))
    harness.send(launch("a", 1, gpu, model, start_deadline_s=600))

    def spawned() -> InstanceRecord | None:
        found = harness.record("a")
        return found if found is not None and found.process is not None else None

    starting = wait_for(spawned, timeout=20, what="the engine's process")
    began = time.monotonic()
    harness.send(Stop(deployment="a", generation=1, reason="deleted"))
    stopped = harness.wait_state("a", "stopped", timeout=20)
    assert time.monotonic() - began < 15, "at once, not at the end of the engine's start"
    assert stopped.process == starting.process
    assert_torn_down(stopped)
    assert harness.transitions() == [
        (None, "starting"),
        ("starting", "starting"),
        ("starting", "stopping"),
        ("stopping", "stopped"),
    ]
    assert harness.device_bytes(stopped) == (0, 0)


def _launched(harness: Hostd, gpu: str, model: Path) -> tuple[InstanceRecord, ProcessIdentity]:
    """`a` launched and ready: its record and its engine's process."""
    harness.send(launch("a", 1, gpu, model))
    ready = harness.wait_state("a", "ready")
    assert ready.process is not None
    return ready, ready.process


def test_a_left_behind_child_is_killed_with_its_group(
    hostd: tuple[Hostd, str], model: Path
) -> None:
    harness, gpu = hostd
    ready, process = _launched(harness, gpu, model)
    wait_for(lambda: len(group_members(process.pgid)) >= 2, timeout=5, what="the EngineCore child")
    os.kill(process.pid, signal.SIGKILL)  # the API server dies; its child holds the memory
    failed = harness.wait_state("a", "failed", timeout=15)
    assert "exited on its own" in (failed.error or "")
    assert group_members(process.pgid) == []
    assert harness.device_bytes(ready) == (0, 0)


def test_a_restarted_hostd_readopts_running_engines(hostd: tuple[Hostd, str], model: Path) -> None:
    harness, gpu = hostd
    harness.send(launch("a", 1, gpu, model))
    harness.send(launch("b", 1, gpu, model, profile="sglang"))
    first = harness.wait_state("a", "ready")
    second = harness.wait_state("b", "ready")
    harness.kill9()
    harness.start()
    wait_for(
        lambda: harness.log.read_text().count('"re-adopted"') >= 2, timeout=10, what="re-adoption"
    )
    assert harness.record("a") == first
    assert harness.record("b") == second
    for name in ("a", "b"):
        harness.send(Stop(deployment=name, generation=1, reason="after re-adoption"))
    for record in (first, second):
        stopped = harness.wait_state(record.deployment, "stopped")
        assert_group_gone(stopped)


def test_stale_and_impossible_commands_are_refused_and_recorded(
    hostd: tuple[Hostd, str], model: Path
) -> None:
    harness, gpu = hostd
    harness.send(launch("a", 2, gpu, model))
    harness.wait_state("a", "ready")
    harness.send(Park(deployment="a", generation=1))
    harness.send(launch("a", 2, gpu, model))
    harness.send(Wake(deployment="a", generation=2))
    harness.send(Park(deployment="ghost", generation=1))

    def refusals() -> list[str] | None:
        found = [e["reason"] for e in harness.events() if e["kind"] == "refused"]
        return found if len(found) >= 4 else None

    reasons = wait_for(refusals, timeout=10, what="four refusals")
    assert "park refused: stale generation 1; the instance is at 2" in reasons
    assert "launch refused: stale generation 2; the instance is at 2" in reasons
    assert "wake refused: the instance is ready" in reasons
    assert "park refused: no such instance on this host" in reasons
    assert harness.record("a").state == "ready"  # type: ignore[union-attr]


def test_engine_logs_are_redacted_owner_only_and_in_redis(
    hostd: tuple[Hostd, str], model: Path
) -> None:
    harness, gpu = hostd
    harness.send(launch("a", 1, gpu, model, profile="sglang"))
    ready = harness.wait_state("a", "ready")
    secret = harness.secret("a")
    assert ready.log_path is not None
    log = Path(ready.log_path)
    text = log.read_text()
    assert "api_key=" in text, "SGLang prints its arguments, key included"
    assert secret not in text
    assert "<redacted>" in text
    assert log.stat().st_mode & 0o777 == 0o600
    raw = cast(list[bytes], harness.client.lrange("capyctl:host:local:instance-log:a:0", 0, -1))
    lines = [line.decode() for line in raw]
    assert lines
    assert all(secret not in line for line in lines)


def test_a_wake_that_answers_differently_is_a_mismatch(
    hostd: tuple[Hostd, str], model: Path, installs: dict[str, Path]
) -> None:
    harness, gpu = hostd
    write_behaviour(
        installs["vllm"], FAST.model_copy(update={"faults": Faults(garbage_after_wake=True)})
    )
    harness.send(launch("a", 1, gpu, model))
    harness.wait_state("a", "ready")
    harness.send(Park(deployment="a", generation=1))
    harness.wait_state("a", "parked")
    harness.send(Wake(deployment="a", generation=1))
    failed = harness.wait_state("a", "failed")
    assert (failed.error or "").startswith("wake_mismatch: the canary answered")
    assert_group_gone(failed)


def test_an_engine_that_died_while_hostd_was_down_is_reaped(
    hostd: tuple[Hostd, str], model: Path
) -> None:
    harness, gpu = hostd
    _, process = _launched(harness, gpu, model)
    harness.kill9()
    os.killpg(process.pgid, signal.SIGKILL)
    wait_for(lambda: not group_members(process.pgid), timeout=5, what="the engine to die")
    harness.start()
    failed = harness.wait_state("a", "failed")
    assert "its engine is gone" in (failed.error or "")
    assert harness.secret_or_none("a") is None, "the per-launch key is dropped"


def test_one_engine_starts_at_a_time_per_gpu(hostd: tuple[Hostd, str], model: Path) -> None:
    harness, gpu = hostd
    harness.send(launch("a", 1, gpu, model))
    harness.send(launch("b", 1, gpu, model))
    harness.wait_state("a", "ready")
    harness.wait_state("b", "ready")
    order = [
        (e["deployment"], e["to_state"])
        for e in harness.events()
        if e["kind"] == "transition" and e["from_state"] != e["to_state"]
    ]
    # Either may go first (the two commands are handled side by side); the other starts only
    # once the first is ready.
    first, second = sorted("ab", key=lambda name: order.index((name, "starting")))
    assert order.index((first, "ready")) < order.index((second, "starting")), order


def test_the_schedulers_reasons_are_in_the_events(hostd: tuple[Hostd, str], model: Path) -> None:
    harness, gpu = hostd
    harness.send(launch("a", 1, gpu, model, reason="demanded by a request"))
    harness.wait_state("a", "ready")
    harness.send(Park(deployment="a", generation=1, reason="switch: least recently used"))
    harness.wait_state("a", "parked")
    harness.send(Wake(deployment="a", generation=1, reason="demanded again"))
    harness.wait_state("a", "ready")
    harness.send(Stop(deployment="a", generation=1, reason="idle for 10m"))
    harness.wait_state("a", "stopped")
    steps = [
        (e["to_state"], e["reason"])
        for e in harness.events()
        if e["kind"] == "transition" and e["from_state"] != e["to_state"]
    ]
    assert steps == [
        ("starting", "launch: demanded by a request"),
        ("ready", "ready: health and canary passed"),
        ("parking", "park: switch: least recently used"),
        ("parked", "parked (host_backed)"),
        ("waking", "wake: demanded again"),
        ("ready", "ready after wake: wake calls and canary passed"),
        ("stopping", "stop: idle for 10m"),
        ("stopped", "stopped: idle for 10m"),
    ]
