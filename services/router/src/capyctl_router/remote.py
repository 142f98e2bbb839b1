"""How a server's router reaches the engines of joined hosts: through each host's ingress
(`capycommon.ingress`), over mutual TLS.

The router holds one client TLS context: the server authority's CA, the router's own
certificate (`paths.router_certificate`, issued by the authority at each server start), and
a certificate required of the peer. Hosts are dialed by address and their certificates name
the host's id (`urn:capyctl:host:<id>`), not a DNS name, so the hostname check is off; the
router checks instead, once a connection, that the certificate is a host's with the id the
server recorded for the host it meant to reach (`HostIdentity.host_id`). Any other
certificate fails the connection like a refused one, naming the host.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass

from capycommon import pki
from capycommon.authority import CERT_FILE
from capycommon.domain.hosts import HostIdentity, HostInfo
from capycommon.errors import CertificateInvalid, CredentialsUnusable
from capycommon.paths import StatePaths, read_private
from capycommon.settingvalues import split_dial_address

RESTART = (
    "start the server role again (`capyctl start`): each start issues the router's certificate"
)


@dataclass(frozen=True, slots=True)
class Ingress:
    """A joined host's ingress, as the router dials it: where, and whose certificate it must
    present. One pool of connections per value: a host that joined again (a new id) or moved
    gets new ones."""

    host: str  # the host's name
    identity: str  # its id, which its certificate must name
    address: str  # an IP address or a DNS name
    port: int

    @property
    def authority(self) -> str:
        """host:port, as the Host header gives it."""
        address = f"[{self.address}]" if ":" in self.address else self.address
        return f"{address}:{self.port}"

    def __str__(self) -> str:
        return f"the ingress of host {self.host} at {self.authority}"

    def refusal(self, transport: asyncio.BaseTransport) -> str | None:
        """What is wrong with the certificate presented on `transport` (`peer_problem`)."""
        return peer_problem(transport, self)


def ingress_of(host: str, info: HostInfo | None, identity: HostIdentity | None) -> Ingress | None:
    """The ingress of a joined host, None while it cannot be reached: its hostd has not said
    where it serves, the server has no record of it, or the server revoked it."""
    if info is None or info.ingress is None or identity is None or identity.revoked_at is not None:
        return None
    try:
        address, port = split_dial_address(info.ingress)
    except ValueError:
        return None  # hostd checks its own setting: not one a host of this release writes
    return Ingress(host=host, identity=identity.host_id, address=address, port=port)


def client_context(paths: StatePaths) -> ssl.SSLContext:
    """The router's TLS context for the hosts' ingresses. Refused, naming the file and the
    fix, when the router's certificate or the authority's is missing or unusable."""
    certificate = paths.router_certificate
    authority = paths.authority_dir / CERT_FILE
    read_private(certificate, missing=RESTART, fix=RESTART)  # owner-only, as a key must be
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False  # the peer check below stands in for it
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_verify_locations(cafile=authority)
    except (OSError, ssl.SSLError) as exc:
        raise CredentialsUnusable(
            f"cannot load the server's certificate authority {authority} ({exc}); restore "
            "it from a backup"
        ) from None
    try:
        context.load_cert_chain(certificate)
    except (OSError, ssl.SSLError) as exc:
        raise CredentialsUnusable(
            f"cannot load the router's certificate {certificate} ({exc}); {RESTART}"
        ) from None
    return context


def peer_problem(transport: asyncio.BaseTransport, ingress: Ingress) -> str | None:
    """What is wrong with the certificate the ingress presented on `transport` (already
    checked against the authority by the handshake), None when it is the host's own."""
    try:
        facts = pki.peer_of_kind(transport, "host")
    except CertificateInvalid as exc:
        return f"{exc.message}; the address belongs to something else than that host's ingress"
    if facts.identity != ingress.identity:
        return (
            f"it presented the certificate of host id {facts.identity} "
            f"({facts.common_name!r}), not that of host {ingress.host} (id "
            f"{ingress.identity}); the address now belongs to another host, or the host "
            "joined again and has not published its ingress since"
        )
    return None
