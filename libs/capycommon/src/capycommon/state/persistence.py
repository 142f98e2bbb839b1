"""Whether Redis can save what it is given. While it cannot (most often its disk is full) it
refuses every write with MISCONF, and it takes writes again on its own once a save works."""

from __future__ import annotations

import redis


def save_failure(client: redis.Redis) -> str | None:
    """Why Redis refuses writes now, or None while it saves."""
    info = client.info("persistence")
    if info.get("aof_enabled") and info.get("aof_last_write_status") == "err":
        return "its last write to its append-only file failed"
    return None
