"""Tensor-parallel engines on simulated GPUs: one process per rank (vLLM's workers, SGLang's
schedulers), each holding its share on its own device; llama.cpp's one process split over its
devices in one claim; the refusals at start; and a rank that dies taking the engine down."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from capycommon import simgpu
from engines.simulator.helpers import (
    FAST,
    GIB,
    MIB,
    Devices,
    Engine,
    Installs,
    Launcher,
    claim,
    closed_env,
    engine_core,
    group_alive,
    python_argv,
    sparse_file,
    wait_claim,
    wait_group_ended,
    with_group_killed,
)
from enginesim import Behaviour, Faults, RankDies, write_behaviour
from enginesim.install import PythonFamily
from support import children_of, holds_for, live_processes, pid_alive, wait_for

VERSIONS: dict[PythonFamily, str] = {"vllm": "0.17.0", "sglang": "0.5.10"}
WEIGHTS = 2 * GIB
HALF = WEIGHTS // 2
RESIDUE = FAST.residue_bytes
KV = 4 * GIB
LLAMA_BUILD = 6500
# What llama-server holds for a 1 GiB GGUF: the file, 4096 tokens of KV at 128 KiB each, and
# 8 MiB of compute buffers for each of its 4 slots.
LLAMA_NEED = GIB + 4096 * 128 * 1024 + 4 * 8 * MIB


@dataclass(frozen=True)
class Start:
    """Launches engines from the session's installs on the test's devices."""

    installs: Installs
    launcher: Launcher
    devices: Devices
    home: Path

    def python(
        self,
        family: PythonFamily,
        behaviour: Behaviour,
        model: Path,
        visible: int,
        *extra: str,
        **env: str,
    ) -> Engine:
        venv = self.installs.python(family, VERSIONS[family])
        write_behaviour(venv, behaviour)
        argv = python_argv(family, venv, model, "--host", "127.0.0.1", *extra)
        environment = closed_env(venv / "bin", self.home, **self.devices.env(visible), **env)
        return self.launcher.start(argv, environment)

    def llama(self, gguf: Path, visible: int, *extra: str) -> Engine:
        executable = self.installs.llama(LLAMA_BUILD)
        write_behaviour(executable, FAST)
        argv = [str(executable), "-m", str(gguf), "--port", "{port}", *extra]
        return self.launcher.start(argv, closed_env(None, self.home, **self.devices.env(visible)))


@pytest.fixture
def start(installs: Installs, launcher: Launcher, devices: Devices, tmp_path: Path) -> Start:
    return Start(installs, launcher, devices, tmp_path)


@pytest.fixture(scope="module")
def heads_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 GiB of (sparse) weights and 14 attention heads: 2 ranks divide them, 4 do not."""
    folder = tmp_path_factory.mktemp("heads") / "fourteen-heads"
    sparse_file(folder / "model.safetensors", WEIGHTS)
    config = {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 14}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def titled(parent: int) -> dict[str, int]:
    """The live children of `parent`, by their process title (argv[0])."""
    return {p.cmdline.split(" ")[0]: p.pid for p in live_processes() if p.ppid == parent}


def ranks_of(parent: int, title: str, count: int) -> list[int]:
    """The PIDs of the `count` rank processes titled `<title><rank>` under `parent`, by rank."""
    wanted = [f"{title}{rank}" for rank in range(count)]

    def found() -> list[int] | None:
        seen = titled(parent)
        return [seen[name] for name in wanted] if all(name in seen for name in wanted) else None

    return wait_for(found, 10, f"{', '.join(wanted)} under {parent}")


def assert_nothing_left(engine: Engine, devices: Devices) -> None:
    """No process of the engine's group lives and no claim file stays."""
    wait_group_ended(engine.proc.pid)
    assert devices.live_claims() == {}
    assert devices.claim_files() == []


def assert_died_saying(engine: Engine, devices: Devices, *said: str) -> None:
    """The engine exits with a failure, its output says each of `said`, and nothing of it is
    left."""
    assert engine.wait_exit() != 0
    output = engine.output()
    for line in said:
        assert line in output, line
    assert_nothing_left(engine, devices)


def test_vllm_tp2_holds_half_the_weights_on_each_device_and_sleeps_and_wakes_every_rank(
    start: Start, devices: Devices, model_dir: Path
) -> None:
    engine = start.python(
        "vllm",
        FAST,
        model_dir,
        2,
        "--tensor-parallel-size",
        "2",
        "--kv-cache-memory-bytes",
        "4G",
        "--enable-sleep-mode",
        VLLM_SERVER_DEV_MODE="1",
    )
    engine.wait_status(200)
    core = engine_core(engine)
    workers = ranks_of(core, "VLLM::Worker_TP", 2)
    assert set(children_of(core)) == set(workers), "the workers are the EngineCore's children"
    for worker, gpu in zip(workers, devices.gpus[:2], strict=True):
        assert gpu.claims().keys() == {worker}, "one PID on each device: its rank's"
        assert claim(gpu, worker) == (HALF + KV, 0)
    assert devices.gpus[2].claims() == {}
    assert core not in devices.live_claims(), "the EngineCore holds nothing itself"

    assert engine.post("/sleep", params={"level": "1"}).status_code == 200
    for worker, gpu in zip(workers, devices.gpus[:2], strict=True):
        wait_claim(gpu, worker, (RESIDUE, HALF))  # each rank's half of the weights to host
    assert engine.post("/wake_up").status_code == 200
    for worker, gpu in zip(workers, devices.gpus[:2], strict=True):
        assert claim(gpu, worker) == (HALF + KV, 0), "taken back before the wake answered"
    reload: dict[str, Any] = {"method": "reload_weights", "args": [], "kwargs": {}}
    assert engine.post("/collective_rpc", json=reload).json() == {"results": [None, None]}

    assert engine.stop() == 0
    assert_nothing_left(engine, devices)


def test_vllm_sigkill_leaves_the_workers_holding_until_the_group_is_killed(
    start: Start, devices: Devices, model_dir: Path
) -> None:
    engine = start.python("vllm", FAST, model_dir, 2, "-tp", "2")
    engine.wait_status(200)
    core = engine_core(engine)
    workers = ranks_of(core, "VLLM::Worker_TP", 2)
    budget = int(0.9 * 24 * GIB)
    engine.proc.kill()
    engine.wait_exit()
    assert all(pid_alive(pid) for pid in (core, *workers))
    for worker, gpu in zip(workers, devices.gpus[:2], strict=True):
        assert claim(gpu, worker) == (budget, 0)
    with_group_killed(engine.proc.pid)
    assert devices.live_claims() == {}


def test_sglang_tp2_runs_a_scheduler_per_rank_and_releases_and_resumes_every_rank(
    start: Start, devices: Devices, model_dir: Path
) -> None:
    flags = ("--tp-size", "2", "--enable-memory-saver", "--enable-weights-cpu-backup")
    engine = start.python("sglang", FAST, model_dir, 2, "--skip-server-warmup", *flags)
    engine.wait_status(200)
    schedulers = ranks_of(engine.proc.pid, "sglang::scheduler_TP", 2)
    budget = int(0.88 * 24 * GIB)  # of what each device had free; both were empty
    for scheduler, gpu in zip(schedulers, devices.gpus[:2], strict=True):
        assert gpu.claims().keys() == {scheduler}
        assert claim(gpu, scheduler) == (budget, 0)
    assert engine.proc.pid not in devices.live_claims(), "the server holds nothing itself"
    info = engine.get("/server_info").json()
    assert info["internal_states"][0]["memory_usage"]["weights"] == HALF / GIB

    assert engine.post("/release_memory_occupation", json={}).status_code == 200
    for scheduler, gpu in zip(schedulers, devices.gpus[:2], strict=True):
        wait_claim(gpu, scheduler, (RESIDUE, HALF))  # each rank's half backed up to host
    assert engine.post("/resume_memory_occupation", json={}).status_code == 200
    for scheduler, gpu in zip(schedulers, devices.gpus[:2], strict=True):
        assert claim(gpu, scheduler) == (budget, 0)

    assert engine.stop() == 0
    assert_nothing_left(engine, devices)


def test_llama_splits_the_model_over_its_devices_in_one_claim(
    start: Start, devices: Devices, gguf: Path
) -> None:
    engine = start.llama(gguf, 2, "--split-mode", "layer", "--tensor-split", "1,1")
    engine.wait_status(200)
    first, second = devices.gpus[:2]
    pid = engine.proc.pid
    found = simgpu.Claim.model_validate_json(first.claim_file(pid).read_bytes())
    assert (found.uuid, found.bytes) == (first.uuid, LLAMA_NEED // 2)
    assert found.also == {second.uuid: LLAMA_NEED // 2}
    assert claim(first, pid) == claim(second, pid) == (LLAMA_NEED // 2, 0)
    assert devices.claim_files() == [f"{pid}.json"], "one process, one claim file"
    assert engine.stop() == 0
    assert devices.claim_files() == []


def test_llama_split_proportions_and_split_mode_none(
    start: Start, devices: Devices, gguf: Path
) -> None:
    uneven = start.llama(gguf, 3, "-ts", "3/1")
    uneven.wait_status(200)
    first, second, third = devices.gpus[:3]
    quarter = int(LLAMA_NEED / 4)
    assert claim(second, uneven.proc.pid) == (quarter, 0)
    assert claim(first, uneven.proc.pid) == (LLAMA_NEED - quarter, 0)
    assert third.claims() == {}, "a device missing from --tensor-split takes nothing"
    assert uneven.stop() == 0

    main = start.llama(gguf, 2, "--split-mode", "none", "--main-gpu", "1")
    main.wait_status(200)
    assert first.claims() == {}
    assert claim(second, main.proc.pid) == (LLAMA_NEED, 0)
    found = simgpu.Claim.model_validate_json(second.claim_file(main.proc.pid).read_bytes())
    assert found.also == {}
    assert main.stop() == 0


@pytest.mark.parametrize(
    ("family", "flag", "heads", "beyond"),
    [
        (
            "vllm",
            "--tensor-parallel-size",
            "ValueError: Total number of attention heads (14) must be divisible by tensor "
            "parallel size (4).",
            "RuntimeError: world_size (4) is greater than the number of available GPUs (2)",
        ),
        (
            "sglang",
            "--tp-size",
            "AssertionError: num_attention_heads (14) must be divisible by tp_size (4)",
            "RuntimeError: CUDA error: invalid device ordinal (--tp-size 4 needs 4 GPUs, "
            "2 visible)",
        ),
    ],
)
def test_refused_at_start_for_heads_and_for_more_ranks_than_devices(
    start: Start,
    devices: Devices,
    model_dir: Path,
    heads_model: Path,
    family: PythonFamily,
    flag: str,
    heads: str,
    beyond: str,
) -> None:
    indivisible = start.python(family, FAST, heads_model, 4, flag, "4")
    assert indivisible.wait_exit() == 1
    assert heads in indivisible.output()
    assert not group_alive(indivisible.proc.pid)
    too_many = start.python(family, FAST, model_dir, 2, flag, "4")
    assert too_many.wait_exit() == 1
    assert beyond in too_many.output()
    assert not group_alive(too_many.proc.pid)
    assert devices.claim_files() == []
    divisible = start.python(family, FAST, heads_model, 2, flag, "2")
    divisible.wait_status(200)
    assert divisible.stop() == 0


def _dies(rank: int) -> Behaviour:
    dies = RankDies(rank=rank, after_seconds=1.0, exit_code=3, message="RuntimeError: NCCL gone")
    return FAST.model_copy(update={"faults": Faults(rank_dies=dies)})


def _statuses_until_exit(engine: Engine) -> list[int | None]:
    """/health's answers, read as fast as they come, until the engine exits."""
    seen: list[int | None] = []

    def exited() -> bool:
        seen.append(engine.status())
        return engine.proc.poll() is not None

    wait_for(exited, 20, "the engine to exit", interval=0.02)
    return seen


def test_vllm_rank_death_takes_the_whole_engine_down(
    start: Start, devices: Devices, model_dir: Path
) -> None:
    engine = start.python("vllm", _dies(1), model_dir, 2, "--tensor-parallel-size", "2")
    engine.wait_status(200)
    core = engine_core(engine)
    ranks_of(core, "VLLM::Worker_TP", 2)
    assert 503 in _statuses_until_exit(engine), "/health answers 503 before the exit"
    assert_died_saying(
        engine,
        devices,
        "RuntimeError: NCCL gone",
        "Worker proc VllmWorker-1 died unexpectedly, shutting down executor.",
        "EngineDeadError",
    )


def test_sglang_rank_death_takes_the_whole_engine_down(
    start: Start, devices: Devices, model_dir: Path
) -> None:
    engine = start.python(
        "sglang", _dies(0), model_dir, 2, "--skip-server-warmup", "--tp-size", "2"
    )
    engine.wait_status(200)
    ranks_of(engine.proc.pid, "sglang::scheduler_TP", 2)
    assert_died_saying(
        engine,
        devices,
        "Scheduler hit an exception: RuntimeError: NCCL gone",
        "Received sigquit from a child process",
    )


def test_a_rank_the_engine_does_not_run_never_dies(
    start: Start, devices: Devices, model_dir: Path
) -> None:
    engine = start.python("vllm", _dies(1), model_dir, 1)
    engine.wait_status(200)
    core = engine_core(engine)
    wait_for(lambda: core in devices.gpus[0].claims(), 5, "the EngineCore's claim")
    assert titled(core) == {}, "one rank: the EngineCore holds the memory itself"
    holds_for(lambda: engine.status() == 200, 1.5, "the engine with no rank 1 serving")
    assert engine.stop() == 0


@pytest.mark.parametrize("family", ["vllm", "sglang"])
def test_a_group_sigterm_stops_every_rank_and_leaves_no_claim(
    start: Start, devices: Devices, model_dir: Path, family: PythonFamily
) -> None:
    flag = "--tensor-parallel-size" if family == "vllm" else "--tp-size"
    engine = start.python(family, FAST, model_dir, 2, flag, "2")
    engine.wait_status(200)
    wait_for(lambda: len(devices.live_claims()) == 2, 5, "a claim on each device")
    os.killpg(engine.proc.pid, signal.SIGTERM)
    engine.wait_exit()
    assert_nothing_left(engine, devices)


@pytest.mark.parametrize(
    ("family", "said"),
    [
        ("vllm", "Engine core proc EngineCore_DP0 died unexpectedly"),
        ("sglang", "Received sigquit from a child process"),
    ],
)
def test_with_one_rank_the_process_holding_it_dies(
    start: Start, devices: Devices, model_dir: Path, family: PythonFamily, said: str
) -> None:
    engine = start.python(family, _dies(0), model_dir, 1)
    engine.wait_status(200)
    assert_died_saying(engine, devices, "RuntimeError: NCCL gone", said)


@pytest.mark.parametrize(
    ("family", "flag", "title"),
    [
        ("vllm", "--tensor-parallel-size", "VLLM::Worker_TP"),
        ("sglang", "--tp-size", "sglang::scheduler_TP"),
    ],
)
def test_a_rank_killed_from_outside_ends_the_engine_and_no_live_claim_stays(
    start: Start, devices: Devices, model_dir: Path, family: PythonFamily, flag: str, title: str
) -> None:
    engine = start.python(family, FAST, model_dir, 2, flag, "2")
    engine.wait_status(200)
    parent = engine_core(engine) if family == "vllm" else engine.proc.pid
    _, victim = ranks_of(parent, title, 2)
    wait_for(lambda: victim in devices.gpus[1].claims(), 5, "the rank's claim")
    os.kill(victim, signal.SIGKILL)
    assert engine.wait_exit() != 0
    wait_group_ended(engine.proc.pid)
    assert devices.live_claims() == {}
    assert devices.claim_files() == [f"{victim}.json"], "SIGKILL runs no clean-up"
