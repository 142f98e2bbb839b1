"""`retention: zero` as hostd carries it out: the engine keeps no log anywhere and runs with
no core dump, its processes and their children alike (read from /proc); the host's
`retention` is the default a deployment may override either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from capycommon.domain.commands import Stop
from capycommon.domain.hosts import LogTail
from capycommon.domain.instances import InstanceRecord
from capycommon.state import keys
from integration.hostd.harness import HOST, Hostd, launch
from support import group_members


def core_limit(pid: int) -> str:
    """The `Max core file size` line of /proc/<pid>/limits: soft and hard."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max core file size"):
            return " ".join(line.split()[4:6])
    raise AssertionError(f"/proc/{pid}/limits has no core file size")


def logs_of(harness: Hostd, deployment: str) -> list[Path]:
    folder = harness.state / "logs" / "engines" / deployment
    return sorted(folder.rglob("*")) if folder.exists() else []


def started(harness: Hostd, name: str, gpu: str, model: Path, **changes: object) -> InstanceRecord:
    harness.send(launch(name, 1, gpu, model, **changes))
    ready = harness.wait_state(name, "ready")
    assert ready.process is not None
    return ready


@pytest.fixture
def zero_retention(hostd: tuple[Hostd, str], model: Path) -> tuple[Hostd, InstanceRecord]:
    """hostd and its engine `a`, launched with `retention: zero` and ready."""
    harness, gpu = hostd
    return harness, started(harness, "a", gpu, model, retention="zero")


def test_a_zero_retention_engine_keeps_no_log_and_dumps_no_core(
    zero_retention: tuple[Hostd, InstanceRecord],
) -> None:
    harness, ready = zero_retention
    assert ready.process is not None
    assert ready.log_path is None
    assert logs_of(harness, "a") == [], "no log file, not even an empty one"
    members = group_members(ready.process.pgid)
    assert members, "the engine runs"
    assert {pid: core_limit(pid) for pid in members} == dict.fromkeys(members, "0 0")
    filters = {pid: Path(f"/proc/{pid}/coredump_filter").read_text().strip() for pid in members}
    assert filters == dict.fromkeys(members, "00000000"), "no memory in a core, whoever writes it"
    assert not harness.client.exists(keys.instance_log(HOST, "a", 0)), "no lines in Redis"


def tail(harness: Hostd, deployment: str, lines: int = 100) -> LogTail:
    """The tail of an engine's log, asked of hostd as the management API asks it."""

    found = harness.read(lambda s: s.engine_logs.request(HOST, deployment, lines, 10.0))
    assert found is not None, "hostd answered"
    return found


def test_a_zero_retention_engines_recent_lines_are_kept_in_memory_only(
    zero_retention: tuple[Hostd, InstanceRecord],
) -> None:
    harness, ready = zero_retention
    found = tail(harness, "a")
    assert found.kept == "memory"
    assert found.launch_id == ready.launch_id
    assert any("vLLM API server version" in line for line in found.lines), found.lines
    assert len(tail(harness, "a", 2).lines) == 2
    assert logs_of(harness, "a") == [], "still no file"
    (socket,) = harness.state.rglob(f"{ready.launch_id}/log.sock")
    assert socket.stat().st_mode & 0o777 == 0o600, "the owner's alone"
    harness.send(Stop(deployment="a", generation=1, reason="test"))
    harness.wait_state("a", "stopped")
    gone = tail(harness, "a")
    assert gone.kept == "none"
    assert gone.lines == []
    assert "went with its engine" in (gone.note or "")


def test_an_engines_log_file_is_tailed_from_its_host(hostd: tuple[Hostd, str], model: Path) -> None:
    harness, gpu = hostd
    ready = started(harness, "a", gpu, model)
    assert ready.log_path is not None
    found = tail(harness, "a", 5)
    assert found.kept == "file"
    assert found.lines == Path(ready.log_path).read_text().splitlines()[-5:]


@pytest.mark.parametrize(
    ("host", "deployment", "zero"), [("zero", None, True), ("zero", "default", False)]
)
def test_the_hosts_retention_is_the_default_a_deployment_overrides(
    hostd: tuple[Hostd, str], model: Path, host: str, deployment: str | None, zero: bool
) -> None:
    harness, gpu = hostd
    harness.stop()
    harness.settings["CAPYCTL_RETENTION"] = host
    harness.start()
    ready = started(harness, "a", gpu, model, retention=deployment)
    assert ready.process is not None
    assert (ready.log_path is None) is zero
    assert logs_of(harness, "a") == ([] if zero else [Path(str(ready.log_path))])
    assert (core_limit(ready.process.pid) == "0 0") is zero
