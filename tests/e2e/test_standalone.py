"""`capyctl start standalone` with real redis-server, supervisord and service processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from support import (
    SERVICES,
    Role,
    capyctl,
    clean_env,
    pid_alive,
    processes_mentioning,
    role_running,
    short_dir,
    wait_for,
)


@pytest.fixture(scope="module")
def standalone() -> Iterator[Role]:
    """One role for the file's tests that leave it running: those that kill one of its
    processes wait until it is back and the role healthy again."""
    with role_running() as role:
        yield role


def test_every_process_runs_with_a_heartbeat(standalone: Role) -> None:
    shown = standalone.capyctl("status", "--json")
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert status == standalone.status() | {
        "uptime_s": status["uptime_s"],
        "processes": status["processes"],
        "hosts": status["hosts"],
    }, "the command prints what the role's status is"
    assert status["role"] == "standalone"
    assert status["state_dir"] == str(standalone.state_dir)
    assert status["listeners"] == {
        "inference": standalone.inference,
        "management": standalone.management,
    }
    procs = {p["name"]: p for p in status["processes"]}
    assert set(procs) == {"redis", *SERVICES}
    assert {p["state"] for p in procs.values()} == {"RUNNING"}
    pids = {p["pid"] for p in procs.values()}
    assert len(pids) == 5, "each program is its own process"
    for service in SERVICES:
        assert procs[service]["heartbeat_pid"] == procs[service]["pid"]
        assert procs[service]["heartbeat_age_s"] < 5
        assert procs[service]["version"] == "0.1.0"

    assert lease_of(standalone)["here"] is True, "its own scheduler holds the lease"

    text = standalone.capyctl("status")
    assert text.returncode == 0
    assert re.search(r"^scheduler lease\s+held by this server \(epoch \d+", text.stdout, re.M)
    assert "PROCESS" in text.stdout
    assert "router" in text.stdout
    assert "RUNNING" in text.stdout


def test_inference_and_management_keys_guard_their_listeners(standalone: Role) -> None:
    keys = standalone.credentials()
    inference = f"http://{standalone.inference}"
    management = f"http://{standalone.management}"

    assert httpx.get(f"{inference}/health").json() == {"status": "ok"}

    client = openai.OpenAI(base_url=f"{inference}/v1", api_key=keys["api_key"])
    assert list(client.models.list()) == []

    for wrong in ("not-the-key", keys["admin_token"]):
        bad = openai.OpenAI(base_url=f"{inference}/v1", api_key=wrong, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as caught:
            bad.models.list()
        assert caught.value.status_code == 401
        assert caught.value.code == "unauthenticated"

    bare = httpx.get(f"{inference}/v1/models")
    assert bare.status_code == 401
    error = bare.json()["error"]
    assert error["code"] == "unauthenticated"
    assert error["type"] == "authentication_error"
    assert "message" in error

    admin = {"Authorization": f"Bearer {keys['admin_token']}"}
    health = httpx.get(f"{management}/management/v1/health", headers=admin)
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    assert health.headers["cache-control"] == "no-store"
    for headers in ({"Authorization": f"Bearer {keys['api_key']}"}, {}):
        refused = httpx.get(f"{management}/management/v1/health", headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "unauthenticated"


def test_keys_never_reach_logs_or_config_show(standalone: Role) -> None:
    keys = standalone.credentials()
    httpx.get(
        f"http://{standalone.inference}/v1/models",
        headers={"Authorization": f"Bearer {keys['admin_token']}"},
    )
    shown = standalone.capyctl("config", "show", "--json")
    logs = [standalone.output()] + [
        path.read_text(errors="replace") for path in (standalone.state_dir / "logs").iterdir()
    ]
    for secret in keys.values():
        assert secret not in shown.stdout
        for text in logs:
            assert secret not in text


@pytest.mark.parametrize("service", SERVICES)
def test_a_killed_service_is_back_within_seconds(standalone: Role, service: str) -> None:
    before = standalone.processes()[service]["pid"]
    epoch = lease_of(standalone)["epoch"]
    os.kill(before, signal.SIGKILL)

    def back() -> bool:
        now = standalone.processes()[service]
        return bool(
            now["state"] == "RUNNING"
            and now["pid"] != before
            and now["heartbeat_pid"] == now["pid"]
        )

    wait_for(back, timeout=15, what=f"{service} to be restarted")
    # It beats before its listener takes connections again.
    wait_for(standalone.healthy, timeout=15, what=f"{service} to serve again")
    if service == "scheduler":
        # The restarted scheduler is the same server's: it takes the lease over at once,
        # under the next epoch, without waiting out its predecessor's.
        taken = wait_for(
            lambda: lease_of(standalone)["epoch"] > epoch, timeout=5, what="the next epoch"
        )
        assert taken


def lease_of(role: Role) -> dict[str, Any]:
    """The scheduler lease as `capyctl status` shows it, once a scheduler holds it."""

    def held() -> dict[str, Any] | None:
        lease: dict[str, Any] | None = role.status()["scheduler_lease"]
        return lease

    return wait_for(held, timeout=10, what="a scheduler to hold the lease")


def test_a_killed_redis_restarts_and_keeps_what_was_written(standalone: Role) -> None:
    sock = standalone.state_dir / "redis" / "redis.sock"
    client = redis.Redis(unix_socket_path=str(sock))
    client.set("capyctl:test:kept", "yes")
    client.close()
    before = standalone.processes()["redis"]["pid"]
    killed_at = time.time()
    os.kill(before, signal.SIGKILL)

    def restarted() -> bool:
        redis_now = standalone.processes()["redis"]
        return bool(redis_now["state"] == "RUNNING" and redis_now["pid"] != before)

    wait_for(restarted, timeout=15, what="redis-server to be restarted")
    client = redis.Redis(unix_socket_path=str(sock))
    assert client.get("capyctl:test:kept") == b"yes"
    client.close()

    def reconnected() -> bool:
        procs = standalone.processes()
        return all(
            procs[s]["heartbeat_age_s"] is not None
            and time.time() - procs[s]["heartbeat_age_s"] > killed_at
            for s in SERVICES
        )

    wait_for(reconnected, timeout=15, what="every service to write a heartbeat again")
    procs = standalone.processes()
    assert all(procs[s]["state"] == "RUNNING" for s in SERVICES)


def test_sigterm_stops_everything_and_leaves_no_process() -> None:
    with role_running() as role:
        pids = [p["pid"] for p in role.status()["processes"]]
        started = time.monotonic()
        assert role.stop(timeout=30) == 0
        assert time.monotonic() - started < 30
        left = [pid for pid in [*pids, role.proc.pid] if pid_alive(pid)]
        assert left == []
        assert processes_mentioning(str(role.state_dir)) == []
        assert not (role.state_dir / "run" / "role.json").exists()
        gone = role.capyctl("status")
        assert gone.returncode == 27
        # Every service left on its own when told to, none killed for taking too long.
        supervisord = (role.state_dir / "logs" / "supervisord.log").read_text()
        assert "SIGKILL" not in supervisord


def test_ctrl_c_stops_everything() -> None:
    with role_running() as role:
        pids = [p["pid"] for p in role.status()["processes"]]
        role.proc.send_signal(signal.SIGINT)
        assert role.proc.wait(timeout=30) == 0
        assert [pid for pid in pids if pid_alive(pid)] == []


def test_two_roles_run_side_by_side_and_a_state_dir_holds_one(standalone: Role) -> None:
    with role_running() as other:
        assert other.healthy()
        assert standalone.healthy()
        mine = {p["pid"] for p in standalone.status()["processes"]}
        theirs = {p["pid"] for p in other.status()["processes"]}
        assert not mine & theirs
        keys = other.credentials()
        assert keys != standalone.credentials()
        models = httpx.get(
            f"http://{other.inference}/v1/models",
            headers={"Authorization": f"Bearer {keys['api_key']}"},
        )
        assert models.status_code == 200

    again = capyctl(
        "start",
        "standalone",
        "--state-dir",
        str(standalone.state_dir),
        "--listen",
        "127.0.0.1:1",
        env=clean_env(),
    )
    assert again.returncode == 28
    assert again.stderr.startswith("error [state_dir_in_use]: the standalone role (pid ")
    assert str(standalone.state_dir) in again.stderr
    assert standalone.healthy()


def test_status_shows_what_planning_costs(standalone: Role) -> None:
    """The leader writes what its ticks cost from its first tick on; status shows it."""
    planning = wait_for(lambda: standalone.status()["planning"], 10, "the planning times")
    assert planning["ticks"] >= 1
    assert 0 < planning["p50_ms"] <= planning["p99_ms"] <= planning["max_ms"]
    shown = standalone.capyctl("status")
    assert re.search(r"planning +a tick takes [\d.]+ ms \(p50\)", shown.stdout), shown.stdout


def test_status_without_a_running_role(tmp_path: Path) -> None:
    result = capyctl("status", "--state-dir", str(tmp_path))
    assert result.returncode == 27
    assert result.stderr == (
        f"error [role_not_running]: no role is running on the state dir {tmp_path}; "
        "start one with `capyctl start standalone`\n"
    )
    as_json = capyctl("status", "--json", "--state-dir", str(tmp_path))
    assert as_json.returncode == 27
    assert json.loads(as_json.stderr)["code"] == "role_not_running"


def test_a_taken_port_refuses_the_start(standalone: Role) -> None:
    state = short_dir() / "state"
    try:
        result = capyctl(
            "start",
            "standalone",
            "--state-dir",
            str(state),
            "--listen",
            standalone.inference,
            env=clean_env(),
        )
        assert result.returncode == 4
        port = standalone.inference.rsplit(":", 1)[1]
        assert result.stderr.startswith(f"error [service_port_in_use:{port}]: cannot listen on")
        assert processes_mentioning(str(state)) == []
    finally:
        shutil.rmtree(state.parent, ignore_errors=True)


def test_a_host_that_never_joined_is_refused(tmp_path: Path) -> None:
    result = capyctl("start", "host", "--state-dir", str(tmp_path / "h"))
    assert result.returncode == 2
    assert "this host has not joined a server" in result.stderr
    assert "capyctl join host --join-file" in result.stderr


def test_a_killed_launcher_takes_its_processes_with_it() -> None:
    with role_running() as role:
        pids = [p["pid"] for p in role.status()["processes"]]
        role.proc.kill()
        role.proc.wait(timeout=5)
        wait_for(
            lambda: not processes_mentioning(str(role.state_dir)),
            timeout=30,
            what="supervisord and its processes to stop after the launcher died",
        )
        assert [pid for pid in pids if pid_alive(pid)] == []
        assert role.capyctl("status").returncode == 27
