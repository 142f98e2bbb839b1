"""Hosts: what each host publishes about itself (its address, its heartbeat, its engines'
load, its downloads and model-store operations, the engine logs it was asked for), the
identities the server keeps for joined hosts, and the ends of requests the router settles."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from capycommon.domain.strict import Strict

# What a host of this release can do, named in its HostInfo; the server gives a host only
# the work whose capabilities it names, and a host of an earlier release names fewer.
# startup_host_bytes: its memwatch measures a start's host RAM apart from the card's, from
# the engine's own processes (a measured startup peak's host figure is its own).
# tensor_parallel: its hostd launches an engine across several GPUs (`Launch.gpu_uuids`).
STARTUP_HOST_BYTES = "startup_host_bytes"
TENSOR_PARALLEL = "tensor_parallel"
HOST_CAPABILITIES: tuple[str, ...] = (STARTUP_HOST_BYTES, TENSOR_PARALLEL)
Capability = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,63}$")]


class HostInfo(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    # The host's CapyCTL release and its capabilities; a host of a release before 0.1.7
    # names neither, and so has none.
    version: str | None = Field(default=None, max_length=64)
    capabilities: tuple[Capability, ...] = Field(default=(), max_length=64)

    # False where host.deep_park is off: nothing parks deep there, and no engine runs with
    # its development controls.
    deep_park: bool = True
    # False where host.lmcache is off; True where host.retention is zero (its deployments'
    # default): LMCache never starts for them.
    lmcache: bool = True
    retention_zero: bool = False
    # A joined host's ingress as the router dials it (host:port, `capycommon.ingress`);
    # None on a standalone role's own host, whose engines the router reaches on loopback.
    ingress: str | None = None


class Heartbeat(Strict):
    service: str
    pid: int
    version: str
    started_at: float
    last_seen: float


class EngineLoad(Strict):
    """One engine's requests at `read_at`; `last_active_at` is when it last had any."""

    generation: int
    running: int
    waiting: int
    last_active_at: float
    read_at: float

    @property
    def busy(self) -> bool:
        """Whether any request ran or waited at `read_at`."""
        return self.running + self.waiting > 0


class Download(Strict):
    repo: str
    commit: str
    done_bytes: int
    total_bytes: int
    # Bytes a second over the download so far.
    rate: float
    started_at: float
    at: float


class StoreOperation(Strict):
    """A pull or removal in a host's model store: under way, done, or failed with its code."""

    kind: Literal["pull", "remove"]
    state: Literal["running", "done", "failed"]
    # The store's path under the models root, as `capyctl list models` names it.
    name: str
    download: Download | None = None
    code: str | None = None
    message: str | None = None
    at: float


class Invitation(Strict):
    host_name: str
    expires_unix: int
    # The host id a recovery invitation gives back; None for a new host.
    recover_host_id: str | None = None


class HostIdentity(Strict):
    name: str
    host_id: str
    # The serial (hex) and the end of the certificate in use; every earlier one is revoked
    # or superseded.
    serial: str
    not_after: float
    version: str
    joined_at: float
    renewed_at: float | None = None
    revoked_at: float | None = None


class RequestEnd(Strict):
    """The engine of `deployment`'s instance at `generation` no longer holds `request_id`."""

    deployment: str
    instance: int = 0
    generation: int
    request_id: str
    # The engine held the request when hostd aborted it (so it had reached the engine).
    held: bool
    at: float


class LogTail(Strict):
    """What hostd answers: where the log is kept, and its last lines."""

    # file: under the state dir; memory: in its writer's memory only (retention: zero);
    # none: nothing to read (no such instance, or its engine and memory log are gone).
    kept: Literal["file", "memory", "none"]
    lines: list[str]
    launch_id: str | None = None
    # Why there is nothing to read, when kept is none.
    note: str | None = None
