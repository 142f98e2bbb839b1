"""Every Redis key and channel name CapyCTL uses. Nothing else spells a key.

Control-plane keys live under `capyctl:`; everything a host's hostd and memwatch write,
and the command stream they read, lives under `capyctl:host:<host>:`, so a remote host's
Redis user can be limited to its own prefix.
"""

from __future__ import annotations

PREFIX = "capyctl"

CONTROL_SERVICES = frozenset({"router", "scheduler"})
HOST_SERVICES = frozenset({"hostd", "memwatch"})


def host_prefix(host: str) -> str:
    return f"{PREFIX}:host:{host}"


def heartbeat(service: str, host: str) -> str:
    """The heartbeat of one service process; host services under their host's prefix."""
    if service in HOST_SERVICES:
        return f"{host_prefix(host)}:heartbeat:{service}"
    if service in CONTROL_SERVICES:
        return f"{PREFIX}:heartbeat:{service}"
    raise ValueError(f"unknown service {service!r}")


def engines(host: str) -> str:
    """The engine registry a host publishes (JSON of `PublishedEngines`)."""
    return f"{host_prefix(host)}:engines"


def host_notifications(host: str) -> str:
    """The pub/sub channel on which a host's state changes are announced ({kind, id, version})."""
    return f"{host_prefix(host)}:notify"
