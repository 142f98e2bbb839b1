"""The configuration of a role's private redis-server."""

from __future__ import annotations

from dataclasses import dataclass

from capycommon.paths import StatePaths
from capycommon.settingvalues import split_address


@dataclass(frozen=True)
class ControlPort:
    """A server's TLS port for joined hosts: mutual TLS against the server's authority, and
    the ACL file that gives each host its own user."""

    bind: str
    authority: str


def render(paths: StatePaths, control: ControlPort | None = None) -> str:
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
    by the server's authority gets through, and takes its users from its ACL file."""
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
    return "\n".join(lines) + "\n"
