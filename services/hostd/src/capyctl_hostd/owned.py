"""hostd's own record of the engines it launched, kept in its state dir.

Redis holds the instance records, and its data can be lost (an append-only file deleted or
cut short, a flush). An engine whose record went with it would keep its GPU memory with
nothing charging it, and a redeploy would start a second copy beside it. This record, one
entry per engine from its launch until its processes are gone, lets hostd find such an
engine and stop it. It never holds the engine's key: that stays in Redis, and an engine whose
key was lost cannot be called again anyway.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, TypeAdapter

from capycommon.domain.instances import LIVE_STATES, InstanceRecord, ProcessIdentity
from capyctl_hostd.recordfile import RecordFile


class OwnedEngine(BaseModel):
    """One engine hostd launched: what identifies it and what rebuilding it needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    deployment: str
    instance: int
    generation: int
    launch_id: str
    process: ProcessIdentity
    port: int
    gpu_uuid: str | None
    gpu_uuids: tuple[str, ...] = ()
    profile: str | None
    model_path: str | None
    served_name: str | None
    residency: str | None
    log_path: str | None
    runtime_dir: str

    @property
    def member(self) -> str:
        return f"{self.deployment}:{self.instance}"

    @classmethod
    def of(cls, record: InstanceRecord, runtime_root: Path) -> OwnedEngine | None:
        """The entry for the engine `record` names; None while it names no process."""
        if record.launch_id is None or record.process is None or record.port is None:
            return None
        return cls(
            **record.model_dump(include=set(cls.model_fields) - {"runtime_dir"}),
            runtime_dir=str(runtime_root / record.launch_id),
        )

    def counted_by(self, record: InstanceRecord | None) -> bool:
        """Whether `record` charges this engine: it names this launch in a live state."""
        return (
            record is not None
            and record.launch_id == self.launch_id
            and record.state in LIVE_STATES
        )

    def why_uncounted(self, record: InstanceRecord | None) -> str:
        """Why hostd stops this engine, for its log and hostd's."""
        if record is None:
            what = "its record was lost with Redis's data"
        elif record.launch_id != self.launch_id:
            what = f"its record names another launch ({record.launch_id})"
        else:
            what = f"its record says {record.state}"
        return f"{what}; stopped so its memory is not left uncounted"


_ENTRIES = TypeAdapter(list[OwnedEngine])


class OwnedEngines(RecordFile[OwnedEngine]):
    """The record file of hostd's engines."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, _ENTRIES, "engines")
