"""A server's identity, made ready at each start: its certificate authority (made once), a
fresh server certificate for the Redis TLS port and the bootstrap listener (for a replicated
server also what it presents to the other servers), a fresh client certificate for the
router (what it presents to the hosts' ingresses), the control plane's Redis password (made
once), and the Redis ACL file."""

from __future__ import annotations

import secrets
import socket
from datetime import timedelta

from capycommon import pki, replication
from capycommon.authority import CERT_FILE, Authority
from capycommon.enrollment import WILDCARDS
from capycommon.errors import CredentialsUnusable
from capycommon.paths import StatePaths, ensure_private_dir, write_atomic
from capycommon.replication import Secrets
from capycommon.settings import ServerSettings
from capycommon.settingvalues import split_address, split_dial_address
from capycommon.state import acl
from capyctl_cli.redisconf import ControlPort

# The server certificate is issued anew at each start, for about 13 months (the most that
# common TLS clients accept).
SERVER_CERTIFICATE_LIFETIME = timedelta(days=397)
# The router's certificate is issued anew at each start too, for as long, to this name.
ROUTER_NAME = "capyctl-router"


def prepare(
    paths: StatePaths, settings: ServerSettings, shared: Secrets | None = None
) -> ControlPort:
    """`shared`: the replication users' passwords, for a server among replicated ones; its
    certificate is then a client's too, and its Redis knows the replica's and the
    Sentinels' users."""
    ensure_private_dir(paths.identity_dir)
    authority = Authority.ensure(paths.authority_dir, "CapyCTL server authority")
    replicated = shared is not None
    certificate, key = authority.issue_server(
        server_names(settings), SERVER_CERTIFICATE_LIFETIME, client=replicated
    )
    write_atomic(paths.server_key, key.decode(), mode=0o600)
    write_atomic(paths.server_certificate, certificate.decode(), mode=0o644)
    issue_router_certificate(paths, authority)
    password = ensure_secret(paths)
    try:
        kept = acl.host_lines(paths.redis_users.read_text(encoding="utf-8"))
    except FileNotFoundError:
        kept = []
    if shared is not None:
        kept = [*replication.redis_user_lines(shared), *kept]
    write_atomic(paths.redis_users, acl.acl_file(password, kept), mode=0o600)
    return ControlPort(settings.enrollment.control_bind, str(authority.folder / CERT_FILE))


def issue_router_certificate(paths: StatePaths, authority: Authority) -> None:
    """The router's client certificate (kind router, its identity kept from the first start)
    and a new private key, in one owner-only file: one rename replaces both."""
    key = pki.new_private_key()
    certificate = authority.sign_request(
        pki.certificate_request(key, ROUTER_NAME),
        kind="router",
        name=ROUTER_NAME,
        identity=router_id(paths),
        lifetime=SERVER_CERTIFICATE_LIFETIME,
    )
    write_atomic(paths.router_certificate, (certificate + key).decode(), mode=0o600)


def router_id(paths: StatePaths) -> str:
    """The router's identity, made on the first start and kept."""
    file = paths.router_id
    if not file.exists():
        write_atomic(file, pki.new_identity() + "\n", mode=0o600)
    found = file.read_text(encoding="utf-8").strip()
    if not pki.IDENTITY_PATTERN.fullmatch(found):
        raise CredentialsUnusable(
            f"{file} does not hold a router identity ({found[:40]!r}); delete it, and the "
            "next start makes a new one"
        )
    return found


def ensure_secret(paths: StatePaths) -> str:
    if not paths.redis_password.exists():
        write_atomic(paths.redis_password, secrets.token_urlsafe(32) + "\n", mode=0o600)
    return paths.redis_password.read_text(encoding="utf-8").strip()


def server_names(settings: ServerSettings) -> list[str]:
    """Every name hosts may dial the server by: the enrollment addresses, the listeners'
    own addresses, loopback, this machine's hostname, and the address its peers dial it
    by (`replication.advertise`)."""
    enrollment = settings.enrollment
    names = ["127.0.0.1", "::1", "localhost", socket.gethostname()]
    for bind in (enrollment.control_bind, enrollment.bootstrap_bind):
        host, _ = split_address(bind)
        if host not in WILDCARDS:
            names.append(host)
    for address in (enrollment.control_address, enrollment.bootstrap_address):
        if address is not None:
            names.append(split_dial_address(address)[0])
    if settings.replication.advertise is not None:
        names.append(settings.replication.advertise)
    return list(dict.fromkeys(names))
