"""Servers joining a replicated server: `capyctl invite server` writes a peer file on a
server, and `capyctl start server --peer-file F` installs it in the next server's state dir.

The peer file carries the cluster's shared secrets (`capycommon.peerfile`). It is read from
the state dir directly, so a stopped server invites as a running one does; installing it is
done once, on a state dir that holds no authority yet, and is a no-op on one that holds the
same authority (every later start of a server first started from it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from capycommon import credentials, peerfile
from capycommon.authority import CERT_FILE, KEY_FILE, Authority
from capycommon.errors import IdentityConflict, InvalidConfig, InvalidRequest
from capycommon.paths import StatePaths, ensure_private_dir, resolve_state_dir, write_atomic
from capycommon.peerfile import PeerFile
from capycommon.pki import pem_of_private_key
from capycommon.redistarget import read_secret
from capycommon.replication import ensure_secrets, keep_initial_primary, write_secrets
from capycommon.settings import ServerSettings
from capycommon.settingsources import load_settings, locate_document
from capycommon.settingvalues import split_address
from capycommon.version import __version__
from capyctl_cli import output
from capyctl_cli.options import ConfigOpt, JsonOpt, StateDirOpt, command_group, expected_errors
from capyctl_cli.settingflags import SettingsCommand, setting_flags

invite_app = command_group("Invite another server to replicate this one.")

PeerFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--peer-file",
        help="Join the servers of this peer file (from `capyctl invite server`): installed "
        "in the state dir on its first start.",
        show_default=False,
    ),
]


def make(paths: StatePaths, settings: ServerSettings) -> PeerFile:
    """The peer file of the server on `paths`: its shared secrets, and its own address as the
    primary the next server follows first."""
    replication = settings.replication
    if replication.advertise is None:
        raise InvalidConfig(
            "replication is not configured on this server: another server can replicate it "
            "only once it runs with replication.advertise and replication.peers (in its role "
            "document, its CAPYCTL_* variables, or the same flags here); set them, restart "
            "it, and invite again"
        )
    if not (paths.authority_dir / CERT_FILE).exists():
        raise InvalidConfig(
            f"{paths.root} holds no server authority yet ({paths.authority_dir}); start the "
            "server once (capyctl start server), then invite"
        )
    authority = Authority.load(paths.authority_dir)
    found = credentials.load(paths.credentials)
    return PeerFile(
        version=__version__,
        primary=replication.advertise,
        redis_port=split_address(settings.enrollment.control_bind)[1],
        sentinel_port=replication.sentinel_port,
        server_ca=authority.certificate_pem.decode(),
        server_ca_key=pem_of_private_key(authority.key).decode(),
        redis_password=read_secret(paths.redis_password),
        api_key=found.api_key,
        admin_token=found.admin_token,
        replication=ensure_secrets(paths.replication_secrets),
    )


def install(paths: StatePaths, settings: ServerSettings, peer: PeerFile) -> bool:
    """Install `peer` in a state dir that holds no authority (its first start); whether it
    did: False for one that holds the peer file's authority already. A state dir of another
    authority is refused: it is another server's, or another cluster's.

    The authority's certificate is written last, so a start cut short installs it all again."""
    _check_settings(settings, peer)
    certificate = paths.authority_dir / CERT_FILE
    if certificate.exists():
        kept = Authority.load(paths.authority_dir)
        if kept.fingerprint == peer.fingerprint:
            return False
        raise IdentityConflict(
            f"this state dir already holds a server authority ({certificate}, SHA-256 "
            f"{kept.fingerprint[:16]}...), not the peer file's ({peer.fingerprint[:16]}...): "
            "it is another server's or another cluster's; start this server on an empty "
            f"state dir (--state-dir) with the peer file, or stop it and move {paths.identity_dir}"
            f" and {paths.redis_dir} away first"
        )
    ensure_private_dir(paths.identity_dir)
    ensure_private_dir(paths.authority_dir)
    write_atomic(paths.redis_password, peer.redis_password + "\n", mode=0o600)
    write_secrets(paths.replication_secrets, peer.replication)
    credentials.write(
        paths.credentials,
        credentials.Credentials(api_key=peer.api_key, admin_token=peer.admin_token),
    )
    keep_initial_primary(paths.initial_primary, peer.primary)
    write_atomic(paths.authority_dir / KEY_FILE, peer.server_ca_key, mode=0o600)
    write_atomic(certificate, peer.server_ca, mode=0o644)
    return True


def _check_settings(settings: ServerSettings, peer: PeerFile) -> None:
    """The servers share their ports: refuse a server that would listen on others."""
    replication = settings.replication
    if not replication.enabled:
        raise InvalidConfig(
            "a server started from a peer file replicates the server that wrote it: set "
            "replication.advertise (this server's address) and replication.peers (the "
            f"others', {peer.primary} among them)"
        )
    port = split_address(settings.enrollment.control_bind)[1]
    if port != peer.redis_port:
        raise InvalidConfig(
            f"this server's Redis TLS port is {port} (enrollment.control_bind), but the "
            f"servers' is {peer.redis_port}; every server uses the same: set "
            f"enrollment.control_bind to ADDR:{peer.redis_port}"
        )
    if replication.sentinel_port != peer.sentinel_port:
        raise InvalidConfig(
            f"this server's Sentinel port is {replication.sentinel_port}, but the servers' "
            f"is {peer.sentinel_port}; every server uses the same: set "
            f"replication.sentinel_port to {peer.sentinel_port}"
        )


@invite_app.command("server", cls=SettingsCommand)
@expected_errors
@setting_flags("server")
def invite_server(
    ctx: typer.Context,
    flags: dict[str, str | None],
    output_file: Annotated[
        Path,
        typer.Option("--output", help="The peer file to write (owner-only)."),
    ] = Path("server.peer"),
    state_dir: StateDirOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a peer file (owner-only) for the next replicated server.

    It holds the servers' authority and its key, their passwords and keys, and this
    server's address. It reads the state dir, so the server may run or not, and takes the
    setting flags the server starts with (replication.* is needed).
    """
    if output_file.exists() or output_file.is_symlink():
        raise InvalidRequest(f"{output_file} exists; remove it or choose another --output")
    if not output_file.parent.is_dir():
        raise InvalidRequest(
            f"{output_file.parent} is not a folder; make it or choose another --output"
        )
    env = dict(os.environ)
    root, _ = resolve_state_dir(state_dir, env)
    paths = StatePaths(root)
    document = locate_document(config, env, paths.role_document("server"))
    settings = load_settings("server", document=document, env=env, flags=flags).settings
    assert isinstance(settings, ServerSettings)
    peer = make(paths, settings)
    peerfile.write(output_file, peer)
    text = (
        f"wrote {output_file} for the next server (it follows {peer.primary} first).\n"
        f"On that server: capyctl start server --peer-file {output_file.name} "
        "--replication-advertise ITS_ADDRESS --replication-peers THE_OTHERS\n"
        "It holds the servers' authority key and every password: move it over a private "
        "channel and delete it after the first start."
    )
    answer = {"peer_file": str(output_file), "primary": peer.primary}
    output.show(answer, text, as_json=as_json)
