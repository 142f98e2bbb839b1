"""The record a running role leaves in `<state>/run/role.json`, so commands find it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError

from capycommon.paths import StatePaths, write_atomic
from capycommon.redistarget import (
    PRIMARY_URL,
    RedisTarget,
    control_target,
    joined_target,
    primary_target,
)

if TYPE_CHECKING:
    from capycommon.state.stores import Blocking


class RoleRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str
    version: str
    pid: int
    supervisord_pid: int
    started_at: float
    state_dir: str
    document: str | None
    processes: list[str]
    redis_url: str
    host: str | None
    listeners: dict[str, str]
    # A replicated server's address, which its control services' heartbeats carry.
    server: str = ""


def write(paths: StatePaths, record: RoleRecord) -> None:
    write_atomic(paths.role_record, record.model_dump_json(indent=2))


def read(paths: StatePaths) -> RoleRecord | None:
    """The record, or None when it is missing or unreadable."""
    try:
        return RoleRecord.model_validate_json(paths.role_record.read_bytes())
    except (OSError, ValidationError):
        return None


@contextmanager
def state_of(record: RoleRecord, timeout: float = 5.0) -> Iterator[Blocking]:
    """The state in the role's Redis, its client closed on exit."""
    with blocking_to(target_of(record, timeout), timeout) as state:
        yield state


def blocking_to(target: RedisTarget, timeout: float) -> Blocking:
    """The state in the Redis `target` names (the primary, for a target with Sentinels),
    over a client of its own whose every connect and reply waits at most `timeout` seconds.
    Close it when done."""
    # Only the commands that read Redis pay for its client.
    import redis.asyncio as aioredis  # noqa: PLC0415

    from capycommon.state.primary import sentinel_pool  # noqa: PLC0415
    from capycommon.state.stores import Blocking  # noqa: PLC0415

    timeouts: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if target.topology is not None:
        pool = sentinel_pool(
            target.topology, target.client_options(), max_connections=4, timeout=timeout, **timeouts
        )
        return Blocking(aioredis.Redis.from_pool(pool))
    return Blocking(aioredis.Redis.from_url(target.url, **timeouts, **target.client_options()))


def target_of(record: RoleRecord, timeout: float = 5.0) -> RedisTarget:
    """As whom the CLI talks to a running role's Redis: as the role's own services do."""
    paths = StatePaths(Path(record.state_dir))
    if record.role == "server" and record.redis_url == paths.redis_url:
        return control_target(paths)
    if record.role == "server" and record.redis_url == PRIMARY_URL:
        return primary_of(paths, timeout)
    if record.role == "host" and paths.joined.exists():
        target = joined_target(paths)
        if target.url == record.redis_url:
            return target
    return RedisTarget(record.redis_url)


def primary_of(paths: StatePaths, timeout: float) -> RedisTarget:
    """A replicated server's primary, found through the Sentinels the scheduler published in
    Redis, which this server's own Redis holds whether it is the primary or a replica (the
    role's record has only the scheme). Until they are published, or while this server's
    Redis does not answer, this server's own Redis: what a replica holds is read there, and
    a Redis that does not answer is said so by the command that asks it."""
    import redis  # noqa: PLC0415

    local = control_target(paths)
    try:
        with blocking_to(local, timeout) as state:
            topology = state(lambda found: found.topology.read())
    except (redis.RedisError, OSError):
        return local
    return local if topology is None else primary_target(paths, topology)
