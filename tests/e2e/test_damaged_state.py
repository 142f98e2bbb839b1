"""A role whose own data is damaged says so and stops, instead of restarting Redis and every
service in a loop: the error names the damaged file and the repair, and the repair works."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from support import CAPYCTL, free_port, processes_mentioning, start_role

pytestmark = pytest.mark.slow


def _start(state: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [CAPYCTL, "start", "standalone", "--state-dir", str(state), "--host-name", "local"]
    argv += ["--listen", f"127.0.0.1:{free_port()}"]
    argv += ["--management-listen", f"127.0.0.1:{free_port()}"]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=90, check=False)


def _damage(incr: Path) -> None:
    """Overwrite bytes in the middle of the append-only file: not a torn tail, which Redis
    loads on its own, but a record it cannot read."""
    data = incr.read_bytes()
    assert len(data) > 64, "the role wrote nothing to its append-only file"
    incr.write_bytes(data[:20] + b"XXXX" + data[24:])


def test_a_damaged_append_only_file_stops_the_role_with_the_repair() -> None:
    role = start_role()
    state = role.state_dir
    try:
        assert role.stop() == 0
        aof = state / "redis" / "appendonly"
        manifest = aof / "appendonly.aof.manifest"
        (incr,) = aof.glob("*.incr.aof")
        _damage(incr)

        began = time.monotonic()
        found = _start(state, role.env)
        took = time.monotonic() - began
        said = found.stdout + found.stderr
        assert found.returncode == 30, said
        assert f"error [state_corrupt]: Redis cannot load the role's data in {aof}" in said
        assert f"cp -a {aof} {aof}.bak" in said
        assert f"redis-check-aof --fix {manifest}" in said
        assert "Traceback" not in said
        assert took < 60, f"the role took {took:.0f} s to give up"
        assert processes_mentioning(str(state)) == []

        shutil.copytree(aof, aof.with_name("appendonly.bak"))
        repair = subprocess.run(
            ["redis-check-aof", "--fix", str(manifest)],
            input="y\n",
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert repair.returncode == 0, repair.stdout + repair.stderr
        again = start_role(state_dir=state)
        assert again.healthy()
        assert again.stop() == 0
    finally:
        role.stop()
        shutil.rmtree(state.parent, ignore_errors=True)
