"""Which Redis a process of a replicated server, and of a host that joined one, talks to
(`capycommon.redistarget.target_for`): the primary the servers' Sentinels name, as the
control plane's user with the server certificate and its key apart, or as the host's own
user with its host certificate; a server alone and a host of one keep their targets."""

from __future__ import annotations

import time
from pathlib import Path

from capycommon import joined, replication
from capycommon.authority import CERT_FILE
from capycommon.domain.replication import Topology
from capycommon.paths import StatePaths, ensure_private_dir, write_atomic
from capycommon.redistarget import CONTROL_USER, PRIMARY_URL, target_for
from capycommon.replsettings import ReplicationSection
from capycommon.settings import HostSettings, ServerSettings

TOPOLOGY = Topology(
    service="capyctl",
    sentinels=("10.0.0.11:26379", "10.0.0.12:26379"),
    user=replication.DISCOVER_USER,
    password="discover-password",
)


def _server(root: Path) -> StatePaths:
    paths = StatePaths(root)
    ensure_private_dir(paths.identity_dir)
    write_atomic(paths.redis_password, "control-password\n", mode=0o600)
    return paths


def test_a_replicated_servers_processes_find_the_primary_through_every_sentinel(
    tmp_path: Path,
) -> None:
    paths = _server(tmp_path)
    shared = replication.ensure_secrets(paths.replication_secrets)
    section = ReplicationSection(
        advertise="10.0.0.11", peers="10.0.0.12,10.0.0.13", sentinel_port=26380
    )
    target = target_for(ServerSettings(replication=section), paths)
    assert target.url == PRIMARY_URL
    assert target.username == CONTROL_USER
    assert target.password == "control-password"
    assert target.topology is not None
    assert target.topology.sentinels == ("10.0.0.11:26380", "10.0.0.12:26380", "10.0.0.13:26380")
    assert target.topology.password == shared.discover
    options = target.client_options()
    assert options["ssl_certfile"] == str(paths.server_certificate)
    assert options["ssl_keyfile"] == str(paths.server_key)
    assert options["ssl_ca_certs"] == str(paths.authority_dir / CERT_FILE)
    assert "10.0.0.12:26380" in target.described
    assert "control-password" not in target.described


def test_a_server_alone_keeps_its_socket(tmp_path: Path) -> None:
    paths = _server(tmp_path)
    target = target_for(ServerSettings(), paths)
    assert target.url == paths.redis_url
    assert target.topology is None
    assert target.tls is None


def _joined(paths: StatePaths, topology: Topology | None) -> None:
    joined.write(paths, joined_record(topology))
    write_atomic(paths.host_certificate, "certificate and key\n", mode=0o600)
    write_atomic(paths.joined_authority, "authority\n")


def joined_record(topology: Topology | None = None) -> joined.Joined:
    """A joined host's record, as `capyctl join host` leaves it."""
    return joined.Joined(
        host_name="gpu1",
        host_id="a" * 32,
        server_version="0.1.0",
        bootstrap_address="10.0.0.11:7444",
        redis_address="10.0.0.11:7445",
        redis_user="host-gpu1",
        redis_password="host-password",
        joined_at=time.time(),
        topology=topology,
    )


def test_a_host_of_replicated_servers_asks_their_sentinels(tmp_path: Path) -> None:
    paths = StatePaths(tmp_path)
    _joined(paths, TOPOLOGY)
    target = target_for(HostSettings(), paths)
    assert target.topology == TOPOLOGY
    assert target.username == "host-gpu1"
    assert target.url == "rediss://10.0.0.11:7445"  # the role's record keeps where it joined
    options = target.client_options()
    assert options["ssl_certfile"] == str(paths.host_certificate)
    assert "ssl_keyfile" not in options  # the host's certificate file holds its key


def test_a_host_of_one_server_dials_it(tmp_path: Path) -> None:
    paths = StatePaths(tmp_path)
    _joined(paths, None)
    target = target_for(HostSettings(), paths)
    assert target.topology is None
    assert target.url == "rediss://10.0.0.11:7445"
