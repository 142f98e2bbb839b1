"""Hosts joining a server: the addresses a join file gives them, the bootstrap exchange on
the wire, and which versions can talk.

The exchange: the host sends its invitation secret, its name, its version and a certificate
request for a key it made itself (`JoinRequest`) to the server's bootstrap listener, over
TLS pinned to the authority in its join file. The server answers with the signed certificate
and the host's Redis user (`JoinAnswer`).
"""

from __future__ import annotations

import socket

from pydantic import Field

from capycommon.domain.replication import Topology
from capycommon.domain.strict import Strict
from capycommon.settings import HostSettings, ServerSettings
from capycommon.settingvalues import split_address

JOIN_PATH = "/bootstrap/v1/join"
WILDCARDS = frozenset({"0.0.0.0", "::"})


class JoinRequest(Strict):
    invitation_secret: str = Field(repr=False, min_length=64, max_length=64)
    host_name: str = Field(max_length=63)
    version: str = Field(max_length=64)
    certificate_request: str = Field(max_length=16384)
    recover: bool = False


class JoinAnswer(Strict):
    host_id: str
    host_name: str
    certificate: str
    server_version: str
    redis_address: str
    redis_user: str
    redis_password: str = Field(repr=False)
    # Replicated servers: where the host finds the primary (left out otherwise, so a host of
    # an earlier release joins a server that runs alone as before).
    topology: Topology | None = None


def dial_addresses(settings: ServerSettings) -> tuple[str, str]:
    """What a join file tells hosts to dial: (bootstrap HOST:PORT, Redis TLS HOST:PORT). A
    listener on every interface is dialled by this machine's hostname, which the server's
    certificate names too."""
    enrollment = settings.enrollment
    return (
        _dial(enrollment.bootstrap_address, enrollment.bootstrap_bind),
        _dial(enrollment.control_address, enrollment.control_bind),
    )


def ingress_address(settings: HostSettings) -> str:
    """What a joined host tells the server's router to dial for its ingress (HOST:PORT): an
    ingress on every interface is dialled by this machine's hostname."""
    ingress = settings.host.ingress
    return _dial(ingress.address, ingress.bind)


def _dial(address: str | None, bind: str) -> str:
    if address is not None:
        return address
    host, port = split_address(bind)
    if host in WILDCARDS:
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def incompatibility(server: str, host: str) -> str | None:
    """Why a host of version `host` cannot talk to a server of version `server`, or None.
    Releases of one minor line (0.1.x) talk to each other; no other pairs do."""
    if _line(server) == _line(host) and _line(host) is not None:
        return None
    return (
        f"this server runs CapyCTL {server} and the host {host}; a host talks only to a "
        f"server of its own release line ({_describe_line(server)}): install CapyCTL "
        f"{server} on the host"
    )


def _line(version: str) -> tuple[str, str] | None:
    parts = version.split(".")
    if len(parts) < 2 or not all(part.isdigit() for part in parts[:2]):
        return None
    return parts[0], parts[1]


def _describe_line(version: str) -> str:
    line = _line(version)
    return f"{line[0]}.{line[1]}.x" if line is not None else version
