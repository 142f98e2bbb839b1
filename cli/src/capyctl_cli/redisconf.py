"""The configuration of a role's private redis-server."""

from __future__ import annotations

from dataclasses import dataclass, field

from capycommon.paths import StatePaths
from capycommon.replication import REPLICA_USER
from capycommon.settingvalues import split_address


@dataclass(frozen=True)
class ControlPort:
    """A server's TLS port for joined hosts: mutual TLS against the server's authority, and
    the ACL file that gives each host its own user."""

    bind: str
    authority: str


@dataclass(frozen=True)
class Replica:
    """A replicated server's Redis: where its peers dial it, the replica user's password it
    logs in to a primary with, and the primary it follows (None: it is the primary)."""

    advertise: str
    port: int
    password: str = field(repr=False)
    primary: str | None

    def lines(self) -> list[str]:
        """Every replicated Redis logs in to a primary, over TLS with its own certificate
        (`tls-cert-file` is also a TLS client's), as the replica user: a primary too, as
        Sentinel may make it a replica. It tells the primary the address and TLS port its
        peers reach it at, which the Sentinels then learn from the primary."""
        lines = [
            "tls-replication yes",
            f"masteruser {REPLICA_USER}",
            f"masterauth {self.password}",
            f"replica-announce-ip {self.advertise}",
            f"replica-announce-port {self.port}",
        ]
        if self.primary is not None:
            lines.append(f"replicaof {self.primary} {self.port}")
        return lines


def render(
    paths: StatePaths, control: ControlPort | None = None, replica: Replica | None = None
) -> str:
    """Unix socket only (no TCP port), owner-only, AOF with fsync every second. Its
    background work runs twice a second, not ten times: a quiet role's Redis woke ten times
    a second to find nothing to do (keys with a time to live still expire when read).

    Two bounds keep one client from taking Redis from the others (a joined host is such a
    client): a script or function may run 1 s before Redis answers everyone else BUSY, which
    is when the scheduler's guard kills it (`capyctl_scheduler.redisguard`; Redis's default
    is 5 s, and CapyCTL's own scripts take well under a millisecond); and no single value
    may be over 8 MiB (`proto-max-bulk-len`, 512 MiB by default). The largest values
    CapyCTL writes are a deployment's record, whose document the management API takes up to
    1 MiB, and an engine log's tail sent over pub/sub (its lines from the log's last 64 KiB,
    or up to 2,000 lines kept in memory), so 8 MiB leaves them room several times over; a
    bigger value is refused and the connection that sent it closed.

    A server's Redis also listens on its TLS port, where only a client certificate signed
    by the server's authority gets through, and takes its users from its ACL file; among
    replicated servers, it replicates the primary or is it (`Replica`).

    Sentinel rewrites this file when it makes this Redis a replica or the primary (CONFIG
    REWRITE), so a Redis that supervisord restarts keeps its role; the launcher writes it
    anew at each start, following the primary the Sentinels name then."""
    lines = [
        "# Written by capyctl at each start; edits are overwritten.",
        "port 0",
        f"unixsocket {paths.redis_socket}",
        "unixsocketperm 700",
        f"dir {paths.redis_dir}",
        "daemonize no",
        'logfile ""',
        "appendonly yes",
        "appendfsync everysec",
        'appenddirname "appendonly"',
        'save ""',
        "protected-mode yes",
        "hz 2",
        "busy-reply-threshold 1000",
        "proto-max-bulk-len 8mb",
    ]
    if control is not None:
        host, port = split_address(control.bind)
        lines += [
            f"bind {host}",
            f"tls-port {port}",
            f"tls-cert-file {paths.server_certificate}",
            f"tls-key-file {paths.server_key}",
            f"tls-ca-cert-file {control.authority}",
            "tls-auth-clients yes",
            'tls-protocols "TLSv1.2 TLSv1.3"',
            f"aclfile {paths.redis_users}",
        ]
    if replica is not None:
        lines += replica.lines()
    return "\n".join(lines) + "\n"
