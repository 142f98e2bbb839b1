"""What a replicated server writes for its Redis and its Sentinel, and the identity it
prepares: a server without `replication.*` writes what it always wrote; a replicated one
names its advertised address in a certificate that is a client's too, gives its Redis the
replica's and the Sentinels' users, replicates the primary it is told, and writes its
Sentinel's configuration once. Which primary a start follows when no Sentinel answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from capycommon import replication
from capycommon.errors import InvalidConfig
from capycommon.paths import StatePaths, ensure_private_dir
from capycommon.pki import CLIENT_AUTH, SERVER_AUTH
from capycommon.replication import (
    DISCOVER_USER,
    PEER_USER,
    REPLICA_USER,
    SENTINEL_USER,
    Secrets,
)
from capycommon.replsettings import ReplicationSection
from capycommon.settings import ServerSettings
from capycommon.settingsources import load_settings
from capycommon.state import acl
from capyctl_cli import primary, redisconf, roles, sentinelconf, serveridentity
from ports import reserved_everywhere

ADVERTISE = "127.0.0.11"
PEERS = ("127.0.0.12", "127.0.0.13")


def _settings(**flags: str) -> ServerSettings:
    """A replicated server's settings, with `flags` besides."""
    settings = load_settings(
        "server",
        document=None,
        env={},
        flags={
            "--replication-advertise": ADVERTISE,
            "--replication-peers": ",".join(PEERS),
            "--enrollment-control-bind": "0.0.0.0:7445",
            **flags,
        },
    ).settings
    assert isinstance(settings, ServerSettings)
    return settings


def _state(root: Path) -> StatePaths:
    paths = StatePaths(root)
    ensure_private_dir(paths.redis_dir)
    return paths


def _certificate(paths: StatePaths) -> x509.Certificate:
    return x509.load_pem_x509_certificate(paths.server_certificate.read_bytes())


def _usages(certificate: x509.Certificate) -> list[x509.ObjectIdentifier]:
    return list(certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def _addresses(certificate: x509.Certificate) -> list[str]:
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(ip) for ip in names.get_values_for_type(x509.IPAddress)]


def test_a_server_without_replication_keeps_its_certificate_and_users(tmp_path: Path) -> None:
    paths = _state(tmp_path)
    control = serveridentity.prepare(paths, ServerSettings())
    assert _usages(_certificate(paths)) == [SERVER_AUTH]
    users = paths.redis_users.read_text()
    assert REPLICA_USER not in users
    assert SENTINEL_USER not in users
    text = redisconf.render(paths, control)
    for word in ("replicaof", "masteruser", "masterauth", "tls-replication", "announce"):
        assert word not in text


def test_a_replicated_server_is_named_by_its_address_and_is_a_client_too(tmp_path: Path) -> None:
    paths = _state(tmp_path)
    shared = Secrets.generate()
    serveridentity.prepare(paths, _settings(), shared)
    certificate = _certificate(paths)
    assert _usages(certificate) == [SERVER_AUTH, CLIENT_AUTH]
    assert ADVERTISE in _addresses(certificate)
    assert not set(PEERS) & set(_addresses(certificate)), "each server names only itself"


def test_the_acl_file_gives_the_replication_users_their_rights_by_hash(tmp_path: Path) -> None:
    paths = _state(tmp_path)
    shared = Secrets.generate()
    serveridentity.prepare(paths, _settings(), shared)
    rules = acl.host_rules("gpu-a", "p" * 32)[1:]  # as Redis saves it: hashed, no reset
    saved = " ".join(["user", acl.host_user("gpu-a"), *rules]).replace(">ppp", "#ppp")
    paths.redis_users.write_text(paths.redis_users.read_text() + saved + "\n")
    serveridentity.prepare(paths, _settings(), shared)  # the next start
    lines = paths.redis_users.read_text().splitlines()
    replica = [line for line in lines if line.startswith(f"user {REPLICA_USER} ")]
    sentinel = [line for line in lines if line.startswith(f"user {SENTINEL_USER} ")]
    hashed = acl.password_hash(shared.replica)
    assert replica == [f"user {REPLICA_USER} on {hashed} -@all +psync +replconf +ping"]
    assert len(sentinel) == 1
    assert sentinel[0].endswith(" ".join(replication.SENTINEL_RULES))
    assert shared.replica not in paths.redis_users.read_text(), "no password in clear"
    assert [line for line in lines if line.startswith("user host-")] == acl.host_lines(saved), (
        "the hosts' users are carried from one start to the next, the others written anew"
    )


def test_a_replica_logs_in_to_its_primary_over_tls(tmp_path: Path) -> None:
    paths = _state(tmp_path)
    control = serveridentity.prepare(paths, _settings(), Secrets.generate())
    replica = redisconf.Replica(ADVERTISE, 7445, "s" * 43, primary=PEERS[0])
    lines = redisconf.render(paths, control, replica).splitlines()
    assert lines[-6:] == [
        "tls-replication yes",
        f"masteruser {REPLICA_USER}",
        f"masterauth {'s' * 43}",
        f"replica-announce-ip {ADVERTISE}",
        "replica-announce-port 7445",
        f"replicaof {PEERS[0]} 7445",
    ]
    as_primary = redisconf.Replica(ADVERTISE, 7445, "s" * 43, primary=None)
    text = redisconf.render(paths, control, as_primary)
    assert "replicaof" not in text
    assert f"masteruser {REPLICA_USER}" in text, "a primary Sentinel demotes logs in too"


def test_the_sentinel_configuration(tmp_path: Path) -> None:
    paths = _state(tmp_path)
    shared = Secrets.generate()
    settings = _settings(**{"--replication-sentinel-port": "26380"})
    lines = sentinelconf.render(paths, settings, shared, PEERS[0]).splitlines()
    for expected in (
        "port 0",
        "bind 0.0.0.0",
        "tls-port 26380",
        f"tls-cert-file {paths.server_certificate}",
        f"tls-key-file {paths.server_key}",
        "tls-auth-clients yes",
        "tls-replication yes",
        f"sentinel announce-ip {ADVERTISE}",
        "sentinel announce-port 26380",
        f"sentinel monitor capyctl {PEERS[0]} 7445 2",
        f"sentinel auth-user capyctl {SENTINEL_USER}",
        f"sentinel auth-pass capyctl {shared.sentinel}",
        "sentinel down-after-milliseconds capyctl 2000",
        f"sentinel sentinel-user {PEER_USER}",
        f"sentinel sentinel-pass {shared.peer}",
        "user default off",
    ):
        assert expected in lines, expected
    assert lines.index("sentinel resolve-hostnames yes") < lines.index(
        f"sentinel monitor capyctl {PEERS[0]} 7445 2"
    ), "a DNS name is taken only once hostnames are"
    discover = next(line for line in lines if line.startswith(f"user {DISCOVER_USER} "))
    assert "+sentinel|get-master-addr-by-name" in discover
    assert "+@all" not in discover
    assert shared.discover not in "\n".join(lines)


def test_the_sentinel_configuration_is_written_once(tmp_path: Path) -> None:
    paths = _state(tmp_path)
    shared = Secrets.generate()
    assert sentinelconf.ensure(paths, _settings(), shared, ADVERTISE)
    assert paths.sentinel_conf.stat().st_mode & 0o777 == 0o600
    assert paths.sentinel_dir.stat().st_mode & 0o777 == 0o700
    assert sentinelconf.recorded_primary(paths) == ADVERTISE
    # Sentinel rewrites it after a failover: the next start keeps what it recorded.
    text = paths.sentinel_conf.read_text()
    monitor = f"sentinel monitor capyctl {ADVERTISE} 7445 2"
    paths.sentinel_conf.write_text(
        text.replace(monitor, f"sentinel monitor capyctl {PEERS[1]} 7445 2")
    )
    assert not sentinelconf.ensure(paths, _settings(), Secrets.generate(), PEERS[0])
    assert sentinelconf.recorded_primary(paths) == PEERS[1]


def test_a_replicated_server_runs_its_sentinel_after_its_redis(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    alone = roles.prepare("server", tmp_path / "alone", None, env, {})
    assert alone.processes == ("redis", "router", "scheduler")
    assert alone.shared is None
    flags: dict[str, str | None] = {
        "--replication-advertise": ADVERTISE,
        "--replication-peers": PEERS[0],
    }
    replicated = roles.prepare("server", tmp_path / "replicated", None, env, flags)
    assert replicated.processes == ("redis", "sentinel", "router", "scheduler")
    assert replicated.shared == replication.read_secrets(replicated.paths.replication_secrets)
    embedded = {**flags, "--embedded-host": "on", "--host-name": "gpu-main"}
    both = roles.prepare("server", tmp_path / "replicated", None, env, embedded)
    assert both.processes == ("redis", "sentinel", "router", "scheduler", "hostd", "memwatch")
    assert both.shared == replicated.shared, "made once, kept"


@pytest.fixture
def silent() -> Iterator[int]:
    """A Sentinel port held on the three addresses where nothing listens: a start's
    questions are refused at once, as on a cluster's first start."""
    held = reserved_everywhere((ADVERTISE, *PEERS))
    yield held[0].getsockname()[1]
    for sock in held:
        sock.close()


def _unanswered(tmp_path: Path, silent: int) -> tuple[StatePaths, ReplicationSection, Secrets]:
    """A server's state dir, its replication settings with Sentinels that never answer, and
    its secrets."""
    section = _settings(**{"--replication-sentinel-port": str(silent)}).replication
    return _state(tmp_path), section, Secrets.generate()


def test_with_no_sentinel_answering_the_first_start_is_its_own_primary(
    tmp_path: Path, silent: int
) -> None:
    paths, section, shared = _unanswered(tmp_path, silent)
    assert primary.choose(paths, section, shared, timeout=0.5) == ADVERTISE
    assert replication.read_initial_primary(paths.initial_primary) == ADVERTISE, "kept"


def test_with_no_sentinel_answering_a_start_follows_what_it_knew(
    tmp_path: Path, silent: int
) -> None:
    paths, section, shared = _unanswered(tmp_path, silent)
    replication.keep_initial_primary(paths.initial_primary, PEERS[0])  # from its peer file
    assert primary.choose(paths, section, shared, timeout=0.5) == PEERS[0]
    sentinelconf.ensure(paths, _settings(), shared, PEERS[1])  # what its Sentinel recorded
    assert primary.choose(paths, section, shared, timeout=0.5) == PEERS[1]
    assert replication.read_initial_primary(paths.initial_primary) == PEERS[0]


def test_a_damaged_initial_primary_is_refused_by_name(tmp_path: Path) -> None:
    paths = _state(tmp_path)
    ensure_private_dir(paths.sentinel_dir)
    paths.initial_primary.write_text("0.0.0.0\n")
    with pytest.raises(InvalidConfig, match="initial-primary does not hold a server's address"):
        replication.read_initial_primary(paths.initial_primary)
