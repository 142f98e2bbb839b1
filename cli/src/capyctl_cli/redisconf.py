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
