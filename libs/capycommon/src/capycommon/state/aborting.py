"""Redis connections that close at once: the socket goes without TLS's goodbye.

redis-py closes a TLS connection gracefully: its socket stays until the server answers the
goodbye (close_notify), which asyncio waits up to 30 s for. A frozen former primary never
answers, so each connection the Sentinel pool leaves to it would keep its socket that long,
and a loop that ends meanwhile (a service stopping) leaves the socket to the garbage
collector. Nothing is lost by not waiting: a connection closes once its commands are
answered or failed. The pipe's connections close the same way (`pipe._Connection.fail`)."""

from __future__ import annotations

from typing import Any

_MADE: dict[type[Any], type[Any]] = {}


def aborting(connection_class: type[Any]) -> type[Any]:
    """`connection_class` (a redis-py asyncio connection class), closing at once."""
    if getattr(connection_class, "closes_at_once", False):
        return connection_class
    made = _MADE.get(connection_class)
    if made is None:

        class Aborting(connection_class):  # type: ignore[misc]
            closes_at_once = True

            async def disconnect(self, *args: Any, **kwargs: Any) -> None:
                writer = getattr(self, "_writer", None)
                if writer is not None:
                    writer.transport.abort()
                await super().disconnect(*args, **kwargs)

        Aborting.__name__ = Aborting.__qualname__ = f"Aborting{connection_class.__name__}"
        made = _MADE[connection_class] = Aborting
    return made
