"""The record a running role leaves in `<state>/run/role.json`, so commands find it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, ValidationError

from capycommon.paths import StatePaths, write_atomic
from capycommon.redistarget import RedisTarget, control_target, joined_target

if TYPE_CHECKING:
    import redis


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


def write(paths: StatePaths, record: RoleRecord) -> None:
    write_atomic(paths.role_record, record.model_dump_json(indent=2))


def read(paths: StatePaths) -> RoleRecord | None:
    """The record, or None when it is missing or unreadable."""
    try:
        return RoleRecord.model_validate_json(paths.role_record.read_bytes())
    except (OSError, ValidationError):
        return None


@contextmanager
def redis_of(record: RoleRecord, timeout: float = 5.0) -> Iterator[redis.Redis]:
    """A client of the role's Redis, closed on exit."""
    import redis  # noqa: PLC0415 - only the commands that read Redis pay for its client

    target = target_of(record)
    client = redis.Redis.from_url(
        target.url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        **target.client_options(),
    )
    try:
        yield client
    finally:
        client.close()


def target_of(record: RoleRecord) -> RedisTarget:
    """As whom the CLI talks to a running role's Redis: as the role's own services do."""
    paths = StatePaths(Path(record.state_dir))
    if record.role == "server" and record.redis_url == paths.redis_url:
        return control_target(paths)
    if record.role == "host" and paths.joined.exists():
        target = joined_target(paths)
        if target.url == record.redis_url:
            return target
    return RedisTarget(record.redis_url)
