"""The GPU check from a release executable, as scripts/gpu-check --pex runs it: the executable
carries the check's module (PEX_MODULE), its steps say SKIP here without a GPU, and the tests'
step says that a release carries no tests."""

from __future__ import annotations

import subprocess

import pytest

from gpucheckrun import NO_GPU, SCRIPT, nvml_here, steps
from release.builds import ARCH, OLD, Releases
from support import clean_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


@pytest.mark.skipif(nvml_here(), reason="an NVIDIA GPU is here: the check runs its steps")
def test_a_release_executable_runs_the_gpu_check(releases: Releases) -> None:
    pex = releases.folder / f"v{OLD}" / f"capyctl-{OLD}-linux-{ARCH}.pex"
    done = subprocess.run(
        [str(SCRIPT), "--pex", str(pex)],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    head = done.stdout.splitlines()[0]
    assert head.startswith(f"gpu-check: capyctl {OLD}, Python ")
    assert head.endswith("from a release executable")
    found = steps(done.stdout)
    assert found[2] == (
        "SKIP",
        "a release executable carries no tests: run scripts/gpu-check from a clone (after "
        "scripts/setup) for them",
    )
    for number in (1, 3, 4, 5, 6):
        assert found[number] == ("SKIP", NO_GPU)
