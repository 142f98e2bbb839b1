"""A server role bounds what one client takes of its Redis: a script that runs away is
stopped and every service of the server and its host rides it out; a joined host whose keys
take more than its quota is cut off, and the server serves on."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from hostilehost import redis_as_host
from support import (
    Role,
    clean_env,
    join_hosts,
    short_dir,
    start_host,
    start_role,
    wait_for,
)

MiB = 1 << 20
BUSY_LOOP = "local i = 0 while true do i = i + 1 end"


@dataclass
class Server:
    role: Role
    root: Path

    def state(self, host: str) -> Path:
        return self.root / host / "state"

    def control(self) -> redis.Redis:
        return self.role.control(protocol=2)

    def as_host(self, host: str) -> redis.Redis:
        """The server's Redis as `host` dials it: its certificate, user and password."""
        return redis_as_host(self.state(host))

    def pids(self, *roles: Role) -> dict[str, int]:
        return {
            f"{role.role}:{name}": process["pid"]
            for role in roles
            for name, process in role.processes().items()
        }


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    root = short_dir("hostlim")
    (root / "server").mkdir()
    env = clean_env(CAPYCTL_ENROLLMENT_HOST_QUOTA="16MiB")
    role = start_role("server", state_dir=root / "server" / "state", env=env)
    try:
        found = Server(role, root)
        join_hosts(role, root, "a", "b")
        yield found
    finally:
        role.stop()
        shutil.rmtree(root, ignore_errors=True)


def _run_away(client: redis.Redis, answer: dict[str, Any]) -> None:
    try:
        answer["reply"] = client.eval(BUSY_LOOP, 0)
    except redis.ResponseError as exc:
        answer["error"] = str(exc)


def test_a_runaway_script_is_stopped_and_every_service_rides_it_out(server: Server) -> None:
    host = start_host(server.state("a"))
    try:
        before = server.pids(server.role, host)
        answer: dict[str, Any] = {}
        runaway = threading.Thread(target=_run_away, args=(server.control(), answer))
        runaway.start()
        runaway.join(timeout=30)
        assert "killed by user" in answer.get("error", ""), answer
        listed = server.role.capyctl("list", "hosts", "--json")
        assert listed.returncode == 0, listed.stderr
        # Not one process of the server or the host ended meanwhile.
        assert server.pids(server.role, host) == before
        scheduler = (server.role.state_dir / "logs" / "scheduler.log").read_text()
        assert scheduler.count("past its time limit") == 1, scheduler[-4000:]
        assert "stopped it" in scheduler
    finally:
        assert host.stop() == 0


def test_a_host_over_its_quota_is_cut_off_and_the_server_serves_on(server: Server) -> None:
    host = start_host(server.state("b"))
    try:
        greedy = server.as_host("b")
        for index in range(3):
            assert greedy.set(f"capyctl:host:b:junk:{index}", b"x" * (7 * MiB)) is True
        # Cut off at the scheduler's next sweep (every 10 s): the host stops as revoked.
        assert host.proc.wait(timeout=40) == 14, host.output()
        assert "error [host_revoked]" in host.output()
    finally:
        host.stop()
    with pytest.raises(redis.AuthenticationError):
        server.as_host("b").ping()
    control = server.control()
    # Its keys dropped; the control plane may still send it a command (a describe).
    assert set(control.keys("capyctl:host:b:*")) <= {b"capyctl:host:b:commands"}
    listed = server.role.capyctl("list", "hosts", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert (rows["b"]["state"], rows["b"]["revoked"]) == ("revoked", True)
    scheduler = server.role.state_dir / "logs" / "scheduler.log"
    found = wait_for(
        lambda: [line for line in scheduler.read_text().splitlines() if "cut off host b" in line],
        10,
        "the scheduler's line on the cut",
    )
    assert len(found) == 1
    assert "over its quota of 16.0 MiB" in found[0]
