"""Running scripts/gpu-check as a person does, and reading its lines: for the check's tests
from a clone (tests/e2e) and from a release executable (tests/release)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pynvml  # type: ignore[import-untyped]

from support import clean_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check"
STEPS = {
    1: "nvml-attribution",
    2: "nvml-tests",
    3: "role-on-gpu",
    4: "engine-on-cuda",
    5: "models-in-turn",
    6: "clean-drain",
}
WORKING = re.compile(r"^gpu-check: working in (/tmp/gpu-check-\S+)$", re.MULTILINE)
LINE = re.compile(r"^(PASS|FAIL|SKIP) (\d) ([a-z-]+): (.*) \(\d+\.\d s\)$")
NO_GPU = "no NVIDIA GPU to read: NVML does not start (NVML Shared Library Not Found)"


def nvml_here() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def gpu_check(*args: str, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=clean_env(**env),
        timeout=timeout,
        check=False,
    )


def steps(output: str) -> dict[int, tuple[str, str]]:
    """Each step's (status, text), checked to be on one line of its own, in order."""
    found: dict[int, tuple[str, str]] = {}
    for line in output.splitlines():
        match = LINE.match(line)
        if match is not None:
            status, number, name, text = match.groups()
            assert STEPS[int(number)] == name, line
            found[int(number)] = (status, text)
    assert list(found) == list(STEPS), output
    return found


def work_folder(output: str) -> str:
    """The folder the check said it works in (its processes' sockets, logs and state)."""
    found = WORKING.search(output)
    assert found is not None, output
    return found.group(1)
