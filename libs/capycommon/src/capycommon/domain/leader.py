"""The scheduler's lease: which server's scheduler acts, and its fencing epoch.

Every server runs a scheduler; only the one holding the lease plans and sends commands. Each
new holder takes the next epoch, and every instance command it sends carries that epoch, so a
host can refuse a command from a leader that lost the lease without knowing it (paused,
partitioned): its epoch is older than the one the store holds (`capycommon.state.leader`).
"""

from __future__ import annotations

from pydantic import Field

from capycommon.domain.strict import Strict


class Lease(Strict):
    # The server whose scheduler holds it: `<machine>:<state dir>`, stable across restarts.
    server: str = Field(min_length=1, max_length=512)
    # The holding process's own token: a scheduler restarted on the same server takes the
    # lease over at once, under a new epoch.
    token: str = Field(min_length=1, max_length=64)
    epoch: int = Field(ge=1)
    # When this holder took it (Unix seconds).
    since: float


class PlanTimes(Strict):
    """What the leader's planning ticks cost, over its last `ticks` (at most a window), as
    it wrote at `at`: each tick's time from its first read to its last write, and its CPU."""

    server: str = Field(min_length=1, max_length=512)
    ticks: int = Field(ge=0)
    p50_ms: float = Field(ge=0)
    p99_ms: float = Field(ge=0)
    max_ms: float = Field(ge=0)
    cpu_ms: float = Field(ge=0, description="the mean CPU time a tick took")
    at: float
