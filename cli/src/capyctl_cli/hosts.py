"""Hosts joining a server: `invite host` and `revoke host` on the server, `join host` on the
GPU machine, and `status host`.

`join host` makes the host's private key on this machine and sends only a certificate
request, with the invitation's secret, to the server's bootstrap listener. It trusts only
the authority in the join file: a server presenting any other certificate is refused, and
there is no option to skip that check.
"""

from __future__ import annotations

import os
import ssl
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import httpx
import typer
from pydantic import ValidationError

from capycommon import joined as joined_file
from capycommon import joinfile, pki
from capycommon import management as wire
from capycommon.enrollment import JOIN_PATH, JoinAnswer, JoinRequest
from capycommon.errors import (
    AgentUnreachable,
    CapyError,
    CertificateInvalid,
    HostNameChanged,
    IdentityConflict,
    Internal,
    InvalidRequest,
    InvitationRefused,
    NotFound,
    StateDirInUse,
)
from capycommon.paths import StatePaths, ensure_private_dir, resolve_state_dir, write_atomic
from capycommon.units import format_size
from capycommon.version import __version__
from capyctl_cli import output
from capyctl_cli.management import Management
from capyctl_cli.options import HostArg, JsonOpt, StateDirOpt, command_group, expected_errors
from capyctl_cli.rolelock import lock_is_held

invite_app = command_group("Invite a host to join this server.")
join_app = command_group("Join this machine to a server.")
revoke_app = command_group("Revoke a joined host.")
status_app = typer.Typer()  # `capyctl status host`

JOIN_TIMEOUT_S = 30.0


def _paths(state_dir: str | None) -> StatePaths:
    root, _ = resolve_state_dir(state_dir, dict(os.environ))
    return StatePaths(root)


@invite_app.command("host")
@expected_errors
def invite_host(
    name: HostArg,
    output_file: Annotated[
        Path | None,
        typer.Option(
            "--output", help="The join file to write (default: NAME.join).", show_default=False
        ),
    ] = None,
    ttl: Annotated[
        int | None,
        typer.Option(
            "--ttl",
            help="Seconds the invitation stays valid (1-3600; default: the "
            "server's enrollment.invitation_ttl).",
            show_default=False,
        ),
    ] = None,
    recover: Annotated[
        bool, typer.Option("--recover", help="Give a revoked host a new certificate.")
    ] = False,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a join file (owner-only) for one host; it works once, until it expires."""
    target = output_file or Path(f"{name}.join")
    if target.exists() or target.is_symlink():
        raise InvalidRequest(f"{target} exists; remove it or choose another --output")
    if not target.parent.is_dir():
        # Asked before the invitation: a secret is never made for a file that cannot be written.
        raise InvalidRequest(f"{target.parent} is not a folder; make it or choose another --output")
    with Management(_paths(state_dir)) as api:
        answer = api.invite(
            wire.InvitationRequest(host_name=name, lifetime_seconds=ttl, recover=recover)
        )
    join = joinfile.JoinFile.model_validate(answer.join)
    joinfile.write(target, join)
    expires = datetime.fromtimestamp(join.expires_unix, UTC).isoformat(timespec="seconds")
    text = (
        f"wrote {target} for host {name} (valid once, until {expires}).\n"
        f"On the host: capyctl join host --join-file {target.name}"
        + (" --recover" if recover else "")
        + "\nIt holds a secret: move it over a private channel and delete it after use."
    )
    output.show(
        {"join_file": str(target), "host": name, "expires_unix": join.expires_unix},
        text,
        as_json=as_json,
    )


@revoke_app.command("host")
@expected_errors
def revoke_host(name: HostArg, state_dir: StateDirOpt = None, as_json: JsonOpt = False) -> None:
    """Cut a host off: its Redis user removed (its connections closed), its certificate's
    serial revoked; it exits with code 14 and its engines keep running. Safe to repeat."""
    with Management(_paths(state_dir)) as api:
        answer = api.revoke(name)
    said = "revoked" if answer.newly_revoked else "was already revoked"
    text = (
        f"host {name} (id {answer.host_id}) {said}. To bring it back: capyctl invite host "
        f"{name} --recover, then on the host capyctl join host --join-file FILE --recover"
    )
    output.show(answer, text, as_json=as_json)


@join_app.command("host")
@expected_errors
def join_host(
    join_file: Annotated[
        Path, typer.Option("--join-file", help="The join file from `capyctl invite host`.")
    ],
    recover: Annotated[
        bool, typer.Option("--recover", help="Rejoin after a revocation, keeping the host's id.")
    ] = False,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Join this machine to the server that wrote the join file."""
    paths = _paths(state_dir)
    found = join(paths, joinfile.read(join_file), recover=recover)
    text = (
        f"joined the server as host {found.host_name} (id {found.host_id}).\n"
        f"Start it with: capyctl start host --state-dir {paths.root}"
    )
    output.show({"host": found.host_name, "host_id": found.host_id}, text, as_json=as_json)


def join(paths: StatePaths, join: joinfile.JoinFile, *, recover: bool) -> joined_file.Joined:
    """Join with `join`; everything that can be checked here is checked before the server
    is asked, so a mistake does not use the invitation up."""
    _preflight(paths, join, recover=recover)
    name = join.host_name
    key = pki.new_private_key()
    request = JoinRequest(
        invitation_secret=join.invitation_secret,
        host_name=name,
        version=__version__,
        certificate_request=pki.certificate_request(key, name).decode(),
        recover=recover,
    )
    answer = _ask(join, request)
    facts = pki.verify_issued(
        answer.certificate.encode(), join.server_ca.encode(), datetime.now(UTC)
    )
    if facts.common_name != name or facts.identity != answer.host_id:
        raise Internal(
            f"the server issued a certificate for {facts.common_name!r} (id {facts.identity}), "
            f"not for host {name!r} (id {answer.host_id})"
        )
    if not pki.key_matches(answer.certificate.encode(), key):
        raise Internal("the server's certificate is not for the key this host sent")
    ensure_private_dir(paths.root)
    ensure_private_dir(paths.identity_dir)
    # The certificate and its key in one file: a renewal replaces both with one rename.
    write_atomic(paths.host_certificate, answer.certificate + key.decode(), mode=0o600)
    write_atomic(paths.joined_authority, join.server_ca, mode=0o600)
    if not paths.host_name.exists():
        write_atomic(paths.host_name, f"{name}\n")
    found = joined_file.Joined(
        host_name=name,
        host_id=answer.host_id,
        server_version=answer.server_version,
        bootstrap_address=join.server_address,
        redis_address=answer.redis_address,
        redis_user=answer.redis_user,
        redis_password=answer.redis_password,
        joined_at=time.time(),
        topology=answer.topology,
    )
    joined_file.write(paths, found)
    return found


def _preflight(paths: StatePaths, join: joinfile.JoinFile, *, recover: bool) -> None:
    """What this machine can tell is wrong before the invitation is spent."""
    name = join.host_name
    if joinfile.expired(join, datetime.now(UTC)):
        expired = datetime.fromtimestamp(join.expires_unix, UTC).isoformat(timespec="seconds")
        raise InvitationRefused(
            f"the join file for host {name} expired at {expired}; ask for a new one "
            f"(on the server: capyctl invite host {name})"
        )
    if recover != (join.recover_host_id is not None):
        raise InvitationRefused(
            "this join file is a recovery: join with --recover"
            if join.recover_host_id is not None
            else "this join file is not a recovery; join without --recover, or ask for one "
            f"(on the server: capyctl invite host {name} --recover)"
        )
    if lock_is_held(paths):
        raise StateDirInUse(f"a role runs on the state dir {paths.root}; stop it before joining")
    earlier = joined_file.read(paths)
    if earlier is not None and not recover:
        raise IdentityConflict(
            f"this state dir already joined as host {earlier.host_name} (id {earlier.host_id}); "
            "after a revocation, rejoin with --recover; a new host needs another --state-dir"
        )
    if earlier is not None and earlier.host_id != join.recover_host_id:
        raise IdentityConflict(
            f"this state dir is host {earlier.host_name} (id {earlier.host_id}), but the join "
            f"file recovers host id {join.recover_host_id}"
        )
    _check_name(paths, name)


def _check_name(paths: StatePaths, name: str) -> None:
    try:
        kept = paths.host_name.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return
    if kept != name:
        raise HostNameChanged(
            f"this state dir belongs to host {kept!r} ({paths.host_name}), but the join file "
            f"is for host {name!r}; join with another --state-dir, or ask for an invitation "
            f"for {kept!r}"
        )


def _ask(join: joinfile.JoinFile, request: JoinRequest) -> JoinAnswer:
    """POST the request to the bootstrap listener, trusting only the join file's authority."""
    trust = ssl.create_default_context(cadata=join.server_ca)
    url = join.server_address.rstrip("/") + JOIN_PATH
    try:
        with httpx.Client(verify=trust, timeout=JOIN_TIMEOUT_S) as client:
            response = client.post(
                url,
                content=request.model_dump_json().encode(),
                headers={"Content-Type": "application/json"},
            )
    except httpx.ConnectError as exc:
        if isinstance(
            exc.__cause__, ssl.SSLCertVerificationError
        ) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
            raise CertificateInvalid(
                f"the server at {join.server_address} did not present a certificate from the "
                "authority in the join file; the join file is not for this server (or "
                "something stands between them): ask the server's operator for a new one"
            ) from None
        raise AgentUnreachable(
            f"cannot reach the server's bootstrap listener at {join.server_address}: {exc}; "
            "check the address and that its port (enrollment.bootstrap_bind) is reachable "
            "from this machine"
        ) from None
    except httpx.HTTPError as exc:
        raise AgentUnreachable(
            f"the server's bootstrap listener at {join.server_address} did not answer: {exc}"
        ) from None
    if response.is_error:
        try:
            error = wire.ErrorBody.model_validate_json(response.content).error
        except ValidationError:
            raise AgentUnreachable(
                f"the bootstrap listener answered {response.status_code}: {response.text[:200]}"
            ) from None
        raise CapyError(error.message, code=error.code)
    try:
        return JoinAnswer.model_validate_json(response.content)
    except ValidationError:
        raise Internal(
            f"the server's join answer is not one capyctl {__version__} reads; is the server "
            "the same release line?"
        ) from None


@status_app.command("host")
@expected_errors
def status_host(name: HostArg, state_dir: StateDirOpt = None, as_json: JsonOpt = False) -> None:
    """One host: joined, connected, last heartbeat, version, GPUs, engines, revoked."""
    with Management(_paths(state_dir)) as api:
        rows = [row for row in api.hosts() if row.name == name]
    if not rows:
        raise NotFound(f"no host named {name!r}; list them with capyctl list hosts")
    output.show(rows[0], lambda: render_host(rows[0]), as_json=as_json)


def render_host(row: wire.HostRow) -> str:
    seen = "-"
    if row.last_heartbeat is not None:
        seen = f"{max(0.0, time.time() - row.last_heartbeat):.0f} s ago"
    expires = "-"
    if row.certificate_expires is not None:
        expires = datetime.fromtimestamp(row.certificate_expires, UTC).isoformat(timespec="seconds")
    lines = [
        ("host", row.name),
        ("state", row.state),
        ("joined", "yes" if row.joined else "no (this role's own host)"),
        ("host id", row.host_id or "-"),
        ("version", row.version or "-"),
        ("connected", "yes" if row.connected else "no"),
        ("last heartbeat", seen),
        ("revoked", "yes" if row.revoked else "no"),
        ("certificate expires", expires),
        ("engines", ", ".join(row.engines) or "-"),
    ]
    lines += [
        (gpu.name, f"{format_size(gpu.used)} used of {format_size(gpu.total)}") for gpu in row.gpus
    ]
    return output.table(["FIELD", "VALUE"], [list(line) for line in lines])
