"""The primary Redis of replicated servers, wherever it is now: a client pool that asks the
servers' Sentinels for it at each new connection.

The pool is redis-py's Sentinel pool over the services' blocking pool (`pipe.ClosingPool`),
so a replicated target keeps what every service's client has: at most its connections, a
command waiting for a free one, the same timeouts, the same reply parser. Its connections
speak mutual TLS with the target's certificate, and so does each question to a Sentinel,
asked as the user that may only ask where the primary is (`Topology.user`).

After a failover, a connection to the lost primary fails as a lost connection does, and a
primary that came back demoted answers READONLY, which redis-py's Sentinel connection turns
into a ConnectionError: either way the caller sees Redis away for a moment (an outage its
REDIS_ERRORS handling rides out), and the next connection goes to the new primary. Until
the Sentinels have elected it, they name none (MasterNotFoundError, a ConnectionError too).

A former primary may also still run when the Sentinels name another: one that froze past
`replication.down_after` and resumed, or an operator's `SENTINEL FAILOVER`. It takes writes
until the Sentinels make it a replica (8 s and more later), and loses them then. redis-py
asks the Sentinels only when it opens a connection, and a busy pool reuses its own, so the
pool asks them again every RECHECK_S and closes every connection to any other Redis than
the primary they name, the pipe's included: a command on one fails as lost, and goes to the
primary when tried again.

The Sentinels are asked all at once, by name (`Sentinels`): redis-py asks SENTINEL MASTERS
one after the other and takes the first answer, but the Sentinel that leads a failover lists
the former primary there until the whole failover ended, seconds after it named the new one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from capycommon.domain.replication import Topology
from capycommon.state import pipe
from capycommon.state.aborting import aborting
from capycommon.state.pipe import ClosingPool
from capycommon.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# How long a Sentinel may take to connect or answer: one that runs answers at once.
SENTINEL_TIMEOUT_S = 2.0
# How often a pool asks the Sentinels whether the primary moved (one question a second).
RECHECK_S = 1.0


class Sentinels(Sentinel):
    """redis-py's Sentinel client, finding the primary by the address most Sentinels give
    for its name (GET-MASTER-ADDR-BY-NAME), which names a promoted replica at once. All are
    asked at once, and the first address a majority gives is taken: a Sentinel that is down
    costs nothing while the others agree, and one that has not heard of a failover yet is
    outvoted. With no majority, the address most of those that answered give.

    The questions still unanswered once a majority agreed are left to end on their own
    (each within SENTINEL_TIMEOUT_S): a question cancelled on its way closes its connection,
    and every recheck would then open one anew, with its TLS handshake, which a loaded
    machine may not finish in time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        for sentinel in self.sentinels:
            pool = sentinel.connection_pool
            pool.connection_class = aborting(pool.connection_class)
        self._stragglers: set[asyncio.Future[tuple[str, int] | None]] = set()

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        asked = [asyncio.ensure_future(_named(found, service_name)) for found in self.sentinels]
        majority = len(asked) // 2 + 1
        named: Counter[tuple[str, int]] = Counter()
        failures = []
        try:
            for answer in asyncio.as_completed(asked):
                try:
                    address = await answer
                except RedisConnectionError as exc:
                    failures.append(str(exc))
                    continue
                if address is not None:
                    named[address] += 1
                    if named[address] >= majority:
                        return address
        finally:
            self._leave_running(asked)
        if named:
            return named.most_common(1)[0][0]
        said = f": {', '.join(failures)}" if failures else ""
        raise MasterNotFoundError(f"no Sentinel names a primary for {service_name!r}{said}")

    def _leave_running(self, asked: Sequence[asyncio.Future[tuple[str, int] | None]]) -> None:
        for question in asked:
            self._stragglers.add(question)
            question.add_done_callback(self._ended)  # at once for one already done

    def _ended(self, question: asyncio.Future[tuple[str, int] | None]) -> None:
        self._stragglers.discard(question)
        if not question.cancelled():
            question.exception()  # its failure was a straggler's: nobody waits on it

    async def aclose(self) -> None:
        await cancel_and_wait(*self._stragglers)
        await super().aclose()


async def _named(sentinel: aioredis.Redis, service: str) -> tuple[str, int] | None:
    """The primary one Sentinel names for `service`; None when it knows no such name. A
    failure names the Sentinel."""
    ask = ("SENTINEL", "GET-MASTER-ADDR-BY-NAME", service)
    try:
        found = await sentinel.execute_command(*ask)  # type: ignore[no-untyped-call]
    except (RedisError, OSError) as exc:
        where = sentinel.connection_pool.connection_kwargs
        said = f"Sentinel {where.get('host')}:{where.get('port')}: {exc}"
        raise RedisConnectionError(said) from exc
    if not found:
        return None
    host, port = found
    return (host.decode() if isinstance(host, bytes) else str(host)), int(port)


class SentinelPool(SentinelConnectionPool, ClosingPool):
    """redis-py's Sentinel pool on the services' blocking pool: its connections go to the
    primary the Sentinels name, and a command finding all of them in use waits for one.
    From its first connection to its close it asks the Sentinels every RECHECK_S and leaves
    a former primary (`leave_all_but`). Closing it (a client's `aclose`) also closes its
    connections to the Sentinels."""

    _watch: asyncio.Task[None] | None = None

    async def get_master_address(self) -> Any:
        found = await super().get_master_address()  # type: ignore[no-untyped-call]
        if self._watch is None or self._watch.done():
            self._watch = asyncio.create_task(self._recheck(), name="sentinel-recheck")
            self._watch.add_done_callback(_said)
        return found

    async def disconnect(self, inuse_connections: bool = True) -> None:
        if inuse_connections and self._watch is not None:  # the client's close
            await cancel_and_wait(self._watch)
            self._watch = None
        await super().disconnect(inuse_connections)
        if inuse_connections:
            await self.sentinel_manager.aclose()

    async def _recheck(self) -> None:
        while True:
            await asyncio.sleep(RECHECK_S)
            try:
                host, port = await self.sentinel_manager.discover_master(self.service_name)
                await self.leave_all_but((str(host), int(port)))
            except (RedisError, OSError) as exc:  # commands meet the outage themselves
                log.debug("could not ask the Sentinels for the primary: %s", exc)

    async def leave_all_but(self, primary: tuple[str, int]) -> None:
        """Close every connection to another Redis than `primary`, in use or idle, and the
        pipe's: the Sentinels name `primary` now."""
        self.master_address = primary
        connections = (*self._available_connections, *self._in_use_connections)
        stale = [
            connection
            for connection in connections
            if connection.is_connected and _address(connection) != primary
        ]
        left = pipe.leave(self, primary)
        if stale or left:
            log.warning(
                "the Sentinels name another primary Redis; closing the connections to the "
                "former one",
                extra={"primary": f"{primary[0]}:{primary[1]}", "connections": len(stale)},
            )
        await asyncio.gather(*(connection.disconnect() for connection in stale))


def sentinel_pool(
    topology: Topology, client_options: dict[str, Any], **pool_options: Any
) -> SentinelPool:
    """A pool on the primary that `topology`'s Sentinels name. `client_options` are the
    target's (`RedisTarget.client_options`: the user, the password and the TLS files, which
    the Sentinels are asked over too); `pool_options` the pool's size, wait and timeouts."""
    tls = {name: value for name, value in client_options.items() if name.startswith("ssl_")}
    asking = {
        "username": topology.user,
        "password": topology.password,
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        # One try each: the next connect, or the next recheck, asks again.
        "retry": Retry(NoBackoff(), 0),
        "ssl": bool(tls),
        **tls,
    }
    sentinels = Sentinels(topology.addresses(), sentinel_kwargs=asking)
    return SentinelPool(  # type: ignore[no-untyped-call]
        topology.service, sentinels, ssl=bool(tls), **client_options, **pool_options
    )


def _said(task: asyncio.Task[None]) -> None:
    """A recheck that failed (a bug: it rides out every Redis error) is said, and the next
    connection starts another."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("the recheck of the primary failed", exc_info=exc)


def _address(connection: Any) -> tuple[str, int]:
    """Where a Sentinel pool's connection is connected (SentinelManagedConnection's host and
    port, set at each connect)."""
    return str(connection.host), int(connection.port)
