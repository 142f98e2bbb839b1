"""Instances: one engine activation of a deployment, and its lifecycle.

Observed state (what hostd saw) lives apart from desired state (the scheduler's
deployments). Every write of an instance record is a compare-and-set on (state, generation)
done in one Lua script (`capycommon.state.store`), so a stale writer loses cleanly.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from capycommon.domain.strict import Strict


class InstanceState(StrEnum):
    """The instance lifecycle.

        stopped -> starting -> ready -> draining -> parking -> parked -> waking -> ready
        ready | parked -> stopping -> stopped        any -> failed
        (after a restart of hostd) unknown -> reconciling -> a verified state

    The scheduler decides every transition and sends hostd a command. The owner of each
    write:
    - starting, parking, waking, stopping: hostd, when it accepts the command for the
      instance's current generation;
    - ready, parked, stopped, failed: hostd, once it observed the outcome (readiness and the
      canary; memory released; processes proven gone; a launch that died);
    - draining: the scheduler, while the router stops admitting;
    - reconciling: hostd at start, for records whose processes it must verify.
    """

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    PARKING = "parking"
    PARKED = "parked"
    WAKING = "waking"
    STOPPING = "stopping"
    FAILED = "failed"
    RECONCILING = "reconciling"


# States in which the instance's engine processes may be alive and hold memory.
LIVE_STATES = frozenset(
    {
        InstanceState.STARTING,
        InstanceState.READY,
        InstanceState.DRAINING,
        InstanceState.PARKING,
        InstanceState.PARKED,
        InstanceState.WAKING,
        InstanceState.STOPPING,
        InstanceState.RECONCILING,
    }
)


class ProcessIdentity(Strict):
    """An engine's process, recognised by PID and start time (so PID reuse is detected)."""

    pid: int
    pgid: int
    start_ticks: int  # /proc/<pid>/stat field 22: start time in clock ticks after boot


class CacheRecord(Strict):
    """The private LMCache server beside an instance (`capycommon.engines.lmcache`). It may
    outlive the instance's engine: a restart_only park keeps it, and the next launch of the
    deployment's revision connects to it again."""

    profile: str
    version: str
    fingerprint: str
    revision: int
    zmq_port: int
    http_port: int
    metrics_port: int
    pool_bytes: int
    process: ProcessIdentity
    # Its log (the log of the launch that started it); None when none is kept.
    log_path: str | None = None
    # What the scheduler charges for it: host RAM (its pool and its own memory) and on the
    # instance's GPU; a stopped instance whose server was kept is charged these alone.
    host_bytes: int
    device_bytes: int


class InstanceRecord(Strict):
    """What hostd observed of one instance."""

    deployment: str
    instance: int
    revision: int
    generation: int
    state: InstanceState
    since: float = Field(description="unix time the instance entered its state")
    host: str
    launch_id: str | None = None
    profile: str | None = None
    family: str | None = None
    # The engine's version, as its registration read it (which APIs it serves follows).
    version: str | None = Field(default=None, max_length=64)
    fingerprint: str | None = None
    served_name: str | None = None
    model_path: str | None = None
    residency: str | None = None
    gpu_uuid: str | None = None
    # Every GPU of its set in rank order, for an engine across several (gpu_uuid is the
    # first); empty for one GPU.
    gpu_uuids: tuple[str, ...] = Field(default=(), max_length=64)
    port: int | None = None
    process: ProcessIdentity | None = None
    log_path: str | None = None
    shm_segments: tuple[str, ...] = ()
    # The canary's answer at first readiness; a wake must answer the same.
    canary: str | None = None
    error: str | None = None
    # Its LMCache server, while one runs for it (through a restart_only park too).
    cache: CacheRecord | None = None
    # What its model serves: chat, or decisions (a decision model).
    api: Literal["chat", "decisions"] = "chat"

    @property
    def member(self) -> str:
        return f"{self.deployment}:{self.instance}"

    @property
    def devices(self) -> tuple[str, ...]:
        """The UUIDs of every GPU it runs on, in rank order; empty while it has none."""
        if self.gpu_uuids:
            return self.gpu_uuids
        return (self.gpu_uuid,) if self.gpu_uuid else ()


class Event(Strict):
    """One thing that happened to an instance, with why and how long it took."""

    # transition: a record changed state; refused: a command hostd would not carry out; fenced: a
    # command from a scheduler that had lost its lease, refused (apart from `refused`, which
    # answers the current leader's effects); uncounted: an engine no record counted (Redis lost
    # it) was stopped; download: a model download from the Hub ended (for a launch of
    # `deployment`, or for a pull when that is empty).
    kind: Literal["transition", "refused", "fenced", "uncounted", "download"]
    host: str
    deployment: str
    instance: int
    generation: int
    from_state: str | None = None
    to_state: str | None = None
    reason: str
    duration_s: float | None = None
    # The engine's own part of duration_s: its load (a start, from its spawn to its health),
    # its wake calls (a wake), its sleep call (a park); the rest is CapyCTL's.
    engine_s: float | None = None
    at: float
    # A download's repository, the bytes it received, and how it ended.
    repo: str | None = None
    received_bytes: int | None = None
    outcome: Literal["done", "failed"] | None = None
