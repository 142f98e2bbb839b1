"""The configuration of a role's private redis-server."""

from __future__ import annotations

from capycommon.paths import StatePaths


def render(paths: StatePaths) -> str:
    """Unix socket only (no TCP port), owner-only, AOF with fsync every second. Its
    background work runs twice a second, not ten times: a quiet role's Redis woke ten times
    a second to find nothing to do (keys with a time to live still expire when read)."""
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
            "hz 2",
            "",
        ]
    )
