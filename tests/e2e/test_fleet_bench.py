"""The fleet benchmark's smoke test: `bench/fleet.py` at its smallest size (3 stand-in hosts,
10 deployments) runs to its end within a minute and prints every figure."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fleet import ROWS

from gpucheckrun import ROOT
from support import clean_env

pytestmark = pytest.mark.slow


def test_the_fleet_bench_runs_at_its_smallest_size() -> None:
    found = subprocess.run(
        [sys.executable, "bench/fleet.py", "--sizes", "3:10", "--seconds", "2"],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert found.returncode == 0, found.stdout + found.stderr
    lines = {line[:40].strip(): line[40:].split() for line in found.stdout.splitlines()}
    for label, _ in ROWS:
        (value,) = lines[label]
        assert float(value) >= 0, f"{label}: {value}"
