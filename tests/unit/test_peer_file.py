"""The peer file: written by `capyctl invite server` from a replicated server's state dir,
read back whole, installed on the next server's first start (the same authority, passwords
and keys, and the inviting server as the first primary), a no-op on its later starts, and
refused, by a stable code, when it is open to others, damaged, or meant for another
cluster's state dir."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from capycommon import credentials, peerfile, replication
from capycommon.authority import CERT_FILE, KEY_FILE, Authority
from capycommon.errors import CredentialsUnusable, IdentityConflict, InvalidConfig
from capycommon.paths import StatePaths
from capycommon.peerfile import PeerFile
from capycommon.pki import pem_of_private_key
from capycommon.settings import ServerSettings
from capycommon.settingsources import load_settings
from capyctl_cli import peers, roles
from support import capyctl, clean_env

FIRST, SECOND = "10.0.0.11", "10.0.0.12"


def _flags(advertise: str, peer: str, **more: str) -> dict[str, str | None]:
    return {"--replication-advertise": advertise, "--replication-peers": peer, **more}


def _settings(advertise: str = SECOND, peer: str = FIRST, **more: str) -> ServerSettings:
    settings = load_settings("server", document=None, env={}, flags=_flags(advertise, peer, **more))
    assert isinstance(settings.settings, ServerSettings)
    return settings.settings


def _first(root: Path) -> roles.Prepared:
    """A replicated server's state dir, as its first start makes it."""
    return roles.prepare("server", root, None, {"HOME": str(root)}, _flags(FIRST, SECOND))


def _invited(tmp_path: Path) -> tuple[roles.Prepared, Path]:
    first = _first(tmp_path / "first")
    assert isinstance(first.loaded.settings, ServerSettings)
    file = tmp_path / "server.peer"
    peerfile.write(file, peers.make(first.paths, first.loaded.settings))
    return first, file


def test_the_peer_file_carries_the_servers_secrets_and_installs_once(tmp_path: Path) -> None:
    first, file = _invited(tmp_path)
    assert file.stat().st_mode & 0o777 == 0o600
    peer = peerfile.read(file)
    assert peer.primary == FIRST
    assert (peer.redis_port, peer.sentinel_port) == (7445, 26379)

    second = StatePaths(tmp_path / "second")
    assert peers.install(second, _settings(), peer)
    for name in (CERT_FILE, KEY_FILE):
        assert (second.authority_dir / name).read_bytes() == (
            first.paths.authority_dir / name
        ).read_bytes()
    assert (second.authority_dir / KEY_FILE).stat().st_mode & 0o777 == 0o600
    for path in (second.redis_password, second.credentials, second.replication_secrets):
        assert path.stat().st_mode & 0o777 == 0o600
    assert second.redis_password.read_text() == first.paths.redis_password.read_text()
    assert credentials.load(second.credentials) == first.credentials
    assert replication.read_secrets(second.replication_secrets) == first.shared
    assert replication.read_initial_primary(second.initial_primary) == FIRST

    written = {path: path.stat().st_mtime_ns for path in second.identity_dir.rglob("*")}
    assert not peers.install(second, _settings(), peer), "a later start: a no-op"
    assert {path: path.stat().st_mtime_ns for path in second.identity_dir.rglob("*")} == written


def test_a_server_started_from_the_peer_file_shares_the_authority(tmp_path: Path) -> None:
    first, file = _invited(tmp_path)
    root = tmp_path / "second"
    prepared = roles.prepare(
        "server", root, None, {"HOME": str(root)}, _flags(SECOND, FIRST), peerfile.read(file)
    )
    kept = Authority.load(first.paths.authority_dir)
    assert Authority.load(prepared.paths.authority_dir).fingerprint == kept.fingerprint
    assert prepared.credentials == first.credentials
    assert prepared.shared == first.shared


def test_a_state_dir_of_another_authority_is_refused(tmp_path: Path) -> None:
    _, file = _invited(tmp_path)
    other = _first(tmp_path / "other")  # a first server of its own
    with pytest.raises(IdentityConflict, match=r"move .*identity and .*redis away"):
        peers.install(other.paths, _settings(), peerfile.read(file))


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ({"--enrollment-control-bind": "0.0.0.0:7446"}, "Redis TLS port is 7446"),
        ({"--replication-sentinel-port": "26380"}, "Sentinel port is 26380"),
    ],
)
def test_a_server_on_other_ports_is_refused(
    tmp_path: Path, flags: dict[str, str], said: str
) -> None:
    _, file = _invited(tmp_path)
    with pytest.raises(InvalidConfig, match=said):
        peers.install(StatePaths(tmp_path / "second"), _settings(**flags), peerfile.read(file))


def test_a_server_without_replication_neither_invites_nor_installs(tmp_path: Path) -> None:
    first, file = _invited(tmp_path)
    alone = load_settings("server", document=None, env={}, flags={}).settings
    assert isinstance(alone, ServerSettings)
    with pytest.raises(InvalidConfig, match="replication is not configured"):
        peers.make(first.paths, alone)
    with pytest.raises(InvalidConfig, match=r"set replication\.advertise"):
        peers.install(StatePaths(tmp_path / "second"), alone, peerfile.read(file))
    with pytest.raises(InvalidConfig, match="start the server once"):
        peers.make(StatePaths(tmp_path / "never"), _settings())


def _rewritten(file: Path, **changes: object) -> None:
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def test_a_damaged_peer_file_is_refused_naming_the_problem(tmp_path: Path) -> None:
    _, file = _invited(tmp_path)
    other = Authority.create(tmp_path / "other-ca", "another")
    cases: list[tuple[dict[str, object], str]] = [
        ({"server_ca_key": pem_of_private_key(other.key).decode()}, "not the key of server_ca"),
        ({"server_ca": "not a certificate"}, "server_ca: is not a PEM certificate"),
        ({"primary": "0.0.0.0"}, "field primary"),
        ({"replication": {"replica": "short"}}, "field replication"),
    ]
    original = file.read_text()
    for changes, said in cases:
        _rewritten(file, **changes)
        with pytest.raises(CredentialsUnusable, match=said):
            peerfile.read(file)
        file.write_text(original)
    data = json.loads(original)
    del data["redis_password"]
    file.write_text(json.dumps(data))
    with pytest.raises(CredentialsUnusable, match="field redis_password is missing"):
        peerfile.read(file)
    file.write_text("{")
    with pytest.raises(CredentialsUnusable, match="is not JSON"):
        peerfile.read(file)


def test_a_peer_file_others_can_read_is_refused(tmp_path: Path) -> None:
    _, file = _invited(tmp_path)
    os.chmod(file, 0o640)
    with pytest.raises(CredentialsUnusable, match="chmod 600") as refused:
        peerfile.read(file)
    assert refused.value.code == "credentials_unusable"
    assert refused.value.exit_code == 2


def test_the_peer_file_hides_its_secrets_from_its_repr(tmp_path: Path) -> None:
    first, file = _invited(tmp_path)
    peer: PeerFile = peerfile.read(file)
    assert first.credentials is not None
    for secret in (peer.server_ca_key, peer.redis_password, first.credentials.api_key):
        assert secret not in repr(peer)


def _document(state: Path, advertise: str, peer: str) -> None:
    (state / "config").mkdir(parents=True)
    (state / "config" / "server.yaml").write_text(
        f"kind: server\nreplication:\n  advertise: {advertise}\n  peers: {peer}\n"
    )


def test_invite_server_then_init_and_start_from_its_file(tmp_path: Path) -> None:
    """The commands: `invite server` on a replicated server's state dir writes the file
    once; `init server --peer-file` installs it in the next server's; `start server
    --peer-file` on another cluster's state dir refuses to start."""
    first = tmp_path / "first"
    _document(first, FIRST, SECOND)
    env = clean_env(HOME=str(tmp_path))
    assert capyctl("init", "server", "--state-dir", str(first), env=env).returncode == 0
    file = tmp_path / "server.peer"
    invite = ("invite", "server", "--output", str(file), "--state-dir", str(first))
    invited = capyctl(*invite, env=env)
    assert invited.returncode == 0, invited.stderr
    assert f"it follows {FIRST} first" in invited.stdout
    again = capyctl(*invite, env=env)
    assert again.returncode == 2
    assert "exists" in again.stderr

    second = tmp_path / "second"
    _document(second, SECOND, FIRST)
    installed = capyctl(
        "init", "server", "--peer-file", str(file), "--state-dir", str(second), env=env
    )
    assert installed.returncode == 0, installed.stderr
    assert replication.read_initial_primary(StatePaths(second).initial_primary) == FIRST
    assert Authority.load(StatePaths(second).authority_dir).fingerprint == (
        Authority.load(StatePaths(first).authority_dir).fingerprint
    )

    other = _first(tmp_path / "other").paths.root
    started = capyctl(
        "start", "server", "--peer-file", str(file), "--state-dir", str(other),
        *("--replication-advertise", SECOND, "--replication-peers", FIRST),
        env=env,
    )  # fmt: skip
    assert started.returncode == IdentityConflict("").exit_code == 29, started.stdout
    assert "identity_conflict" in started.stdout + started.stderr
