"""The configuration of a role's private redis-server."""

from __future__ import annotations

from capycommon.paths import StatePaths


def render(paths: StatePaths) -> str:
    """Unix socket only (no TCP port), owner-only, AOF with fsync every second."""
    return "\n".join(
        [
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
            "",
        ]
    )
