"""scripts/gpu-check as a person runs it. Here, without a GPU or torch, each GPU step says SKIP
naming what is missing and the command exits 0. Rehearsed on a simulated GPU, with a stand-in
torch that every process of the check imports (through PYTHONPATH, and the engine's venv),
each step that can run without the real device passes with its figures: the same code as on a
GPU, but memwatch's simulated backend in place of NVML."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from faketorch import write_torch
from gpucheckrun import NO_GPU, ROOT, STEPS, gpu_check, nvml_here, steps, work_folder
from support import processes_mentioning


@pytest.mark.skipif(nvml_here(), reason="an NVIDIA GPU is here: the check runs its steps")
def test_without_a_gpu_each_gpu_step_says_skip_naming_nvml_and_it_exits_0() -> None:
    done = gpu_check(timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    found = steps(done.stdout)
    for number in (1, 3, 4, 5, 6):
        assert found[number] == ("SKIP", NO_GPU)
    status, text = found[2]
    assert status == "SKIP"
    assert text.startswith("the 3 NVML-gated tests skipped (no NVIDIA GPU here: ")
    assert text.endswith(" others passed"), "the tests that need no GPU ran and passed"
    head = done.stdout.splitlines()[0]
    assert head.startswith("gpu-check: capyctl ")
    assert head.endswith(f"from a clone at {ROOT}")
    assert "gpu-check: 0 PASS, 0 FAIL, 6 SKIP in " in done.stdout
    assert "logs are kept" not in done.stdout
    assert not Path(work_folder(done.stdout)).exists()


def test_a_release_executable_that_is_not_there_is_refused() -> None:
    done = gpu_check("--pex", "/nonexistent/capyctl.pex", timeout=30)
    assert done.returncode == 2
    assert "gpu-check: no release executable at /nonexistent/capyctl.pex" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rehearsed_on_a_simulated_gpu_every_step_that_can_run_here_passes(
    tmp_path: Path,
) -> None:
    torch = str(write_torch(tmp_path))
    done = gpu_check("--simulated-gpus", "gpu0:24GiB", timeout=540, PYTHONPATH=torch)
    assert done.returncode == 0, done.stdout + done.stderr
    found = steps(done.stdout)
    assert [found[n][0] for n in STEPS] == ["PASS", "SKIP", "PASS", "PASS", "PASS", "PASS"]
    assert re.match(
        r"NVML credited 6\.0 GiB to the child's PID in 3/3 rounds and saw each release "
        r"[\d-]+ ms after the free; CUDA context 500\.0 MiB \(simulated, gpu0 gpu0 24\.0 GiB\)",
        found[1][1],
    ), found[1][1]
    assert found[3][1].startswith("source simulated: gpu0 gpu0 24.0 GiB; host RAM ")
    engine = re.match(
        r"cold start [\d.]+ s, park [\d.]+ s, wake [\d.]+ s; a ([\d.]+ GiB) model held \1 ready, "
        r"0 B parked, \1 woken; startup peak \(with 1\.0 GiB of start-up extra\) measured by "
        r"memwatch ([\d.]+ GiB), read by NVML \2$",
        found[4][1],
    )
    assert engine is not None, found[4][1]
    turns = found[5][1]
    assert turns.startswith("3 models of 8.4 GiB on gpu0 gpu0 24.0 GiB (managed limit 22.1 GiB)")
    assert "asked model-a, model-b, model-c, model-a: all answered" in turns
    assert "drained in " in found[6][1]
    assert "then NVML credited 0 B to the check's processes" in found[6][1]
    assert "gpu-check: 5 PASS, 0 FAIL, 1 SKIP in " in done.stdout
    # Its own folder: other tests run the check too, at the same time.
    folder = work_folder(done.stdout)
    assert processes_mentioning(folder) == [], "nothing of the check left running"
    assert not Path(folder).exists(), "a check that passed keeps no logs"
