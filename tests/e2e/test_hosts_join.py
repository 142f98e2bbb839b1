"""Hosts join a server: two joined hosts on one machine report to the server's Redis over
mutual TLS, show in `list hosts` and `status host`, renew their certificates without a
restart, and keep the name they joined under."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from ports import free_port
from support import Role, capyctl, join_host, short_dir, start_host, start_role, wait_for

# Short enough for a renewal within the test (hosts renew after two thirds of it, counted
# from a minute before issue), long enough for a loaded machine to start a host with it.
LIFETIME_S = 45


@pytest.fixture(scope="module")
def server() -> Iterator[Role]:
    role = start_role("server", extra=("--enrollment-certificate-lifetime", str(LIFETIME_S)))
    try:
        yield role
    finally:
        role.stop()
        shutil.rmtree(role.state_dir.parent, ignore_errors=True)


def _hosts(server: Role) -> dict[str, dict[str, Any]]:
    result = server.capyctl("list", "hosts", "--json")
    assert result.returncode == 0, result.stderr
    return {row["name"]: row for row in json.loads(result.stdout)}


def _as_host(state: Path) -> redis.Redis:
    """A new connection with the host's identity files as they are now."""
    joined = json.loads((state / "identity" / "joined.json").read_text())
    address, port = joined["redis_address"].rsplit(":", 1)
    return redis.Redis(
        host=address,
        port=int(port),
        ssl=True,
        ssl_certfile=str(state / "identity" / "host.pem"),
        ssl_ca_certs=str(state / "identity" / "server-ca.pem"),
        ssl_cert_reqs="required",
        username=joined["redis_user"],
        password=joined["redis_password"],
        socket_timeout=5,
    )


def test_two_hosts_join_and_report_to_the_server(server: Role) -> None:
    folder = short_dir()
    hosts: list[Role] = []
    try:
        for name, gpus, engines in (("gpu-a", "gpu0:24GiB", 1), ("gpu-b", "gpu0:48GiB", 2)):
            state = folder / name
            join_host(server, name, state)
            assert (state / "identity" / "host.pem").stat().st_mode & 0o777 == 0o600
            assert (state / "identity" / "joined.json").stat().st_mode & 0o777 == 0o600
            hosts.append(start_host(state, gpus=gpus, engine_range=engines))

        def reported() -> dict[str, dict[str, Any]] | None:
            rows = _hosts(server)
            ready = all(rows.get(n, {}).get("state") == "ready" for n in ("gpu-a", "gpu-b"))
            return rows if ready else None

        rows = wait_for(reported, timeout=30, what="both hosts' memory readings at the server")
        for name, total in (("gpu-a", 24 << 30), ("gpu-b", 48 << 30)):
            row = rows[name]
            assert row["joined"] is True
            assert row["connected"] is True
            assert row["revoked"] is False
            assert row["version"] == "0.1.0"
            assert time.time() - row["last_heartbeat"] < 10
            assert [gpu["total"] for gpu in row["gpus"]] == [total]
            joined = json.loads((folder / name / "identity" / "joined.json").read_text())
            assert row["host_id"] == joined["host_id"]
            assert joined["redis_user"] == f"host-{name}"

        control = server.control()
        try:
            for name in ("gpu-a", "gpu-b"):
                assert control.exists(f"capyctl:host:{name}:heartbeat:hostd") == 1
                assert control.exists(f"capyctl:host:{name}:heartbeat:memwatch") == 1
                assert control.exists(f"capyctl:host:{name}:memory") == 1
            # Every connection of a host is its own user's, over TLS.
            clients = control.client_list()
            users = {c["user"] for c in clients if c["addr"].startswith("127.0.0.1:")}
            assert users == {"host-gpu-a", "host-gpu-b"}
            assert not control.acl_log(), "no command of the hosts was refused"
        finally:
            control.close()

        shown = server.capyctl("status", "host", "gpu-b")
        assert shown.returncode == 0, shown.stderr
        assert "connected            yes" in shown.stdout
        listed = server.capyctl("list", "hosts")
        assert "gpu-a" in listed.stdout
        assert "gpu-b" in listed.stdout
        for host in hosts:
            assert host.stop() == 0
    finally:
        for host in hosts:
            host.stop()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_host_renews_its_certificate_without_a_restart(server: Role) -> None:
    folder = short_dir()
    state = folder / "gpu-c"
    host: Role | None = None
    try:
        join_host(server, "gpu-c", state)
        first = (state / "identity" / "host.pem").read_bytes()
        first_expiry = _hosts(server)["gpu-c"]["certificate_expires"]
        host = start_host(state, engine_range=1)
        hostd = host.processes()["hostd"]["pid"]

        def renewed() -> bool:
            return (state / "identity" / "host.pem").read_bytes() != first

        wait_for(renewed, timeout=LIFETIME_S + 10, what="the host to renew its certificate")
        assert host.processes()["hostd"]["pid"] == hostd, "renewed without a restart"
        assert _hosts(server)["gpu-c"]["certificate_expires"] > first_expiry
        assert (state / "identity" / "host.pem").stat().st_mode & 0o777 == 0o600
        # A connection opened now presents the renewed certificate, and is let in.
        client = _as_host(state)
        try:
            assert client.ping() is True
        finally:
            client.close()
        # Past the first certificate's end, the host still beats in the server's Redis.
        wait_for(
            lambda: time.time() > first_expiry + 1, timeout=LIFETIME_S + 5, what="first expiry"
        )
        assert host.healthy()
        assert host.processes()["hostd"]["pid"] == hostd
        assert host.stop() == 0
    finally:
        if host is not None:
            host.stop()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_joined_host_keeps_its_name(server: Role) -> None:
    folder = short_dir()
    state = folder / "gpu-d"
    try:
        join_host(server, "gpu-d", state)
        result = capyctl(
            "start", "host", "--state-dir", str(state), "--host-name", "other", timeout=60
        )
        assert result.returncode == 2
        assert result.stderr.startswith("error [host_name_changed]:")
        assert "'gpu-d'" in result.stderr
        again = folder / "again.join"
        invited = server.capyctl("invite", "host", "gpu-d", "--output", str(again))
        assert invited.returncode == 29
        assert invited.stderr.startswith("error [identity_conflict]:")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_new_authority_stops_a_joined_host_until_it_recovers() -> None:
    """The server's authority replaced (its files deleted, the server restarted): a host
    joined under the old one stops with certificate_invalid (exit 3, which its units do not
    restart) instead of retrying for ever, and comes back by revoke and recover."""
    enrollment = (
        "--enrollment-control-bind",
        f"127.0.0.1:{free_port()}",
        "--enrollment-bootstrap-bind",
        f"127.0.0.1:{free_port()}",
    )
    server = start_role("server", extra=enrollment)
    folder = short_dir()
    state = folder / "gpu-e"
    host: Role | None = None
    try:
        join_host(server, "gpu-e", state)
        listeners = (server.inference, server.management)
        assert server.stop() == 0
        for name in ("ca.pem", "ca.key"):
            (server.state_dir / "identity" / "ca" / name).unlink()
        server = start_role(
            "server", state_dir=server.state_dir, listeners=listeners, extra=enrollment
        )
        host = start_host(state, wait=False)
        assert host.proc.wait(timeout=60) == 3
        said = host.output()
        assert "error [certificate_invalid]" in said
        assert "not from the authority this host joined" in said
        assert "--recover" in said
        assert server.capyctl("revoke", "host", "gpu-e").returncode == 0
        join_host(server, "gpu-e", state, "--recover")
        host = start_host(state)
        assert _hosts(server)["gpu-e"]["connected"] is True
        assert host.stop() == 0
    finally:
        if host is not None:
            host.stop()
        server.stop()
        shutil.rmtree(server.state_dir.parent, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


def test_an_invitation_into_a_missing_folder_is_refused_before_any_secret_is_made(
    server: Role, tmp_path: Path
) -> None:
    target = tmp_path / "missing" / "gpu-x.join"
    refused = server.capyctl("invite", "host", "gpu-x", "--output", str(target))
    assert refused.returncode == 2, refused.stderr
    assert f"{target.parent} is not a folder" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert "gpu-x" not in _hosts(server)
