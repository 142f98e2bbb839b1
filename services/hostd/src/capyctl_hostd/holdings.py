"""What hostd holds on its host, and the steps every command shares on it.

hostd holds the engines it started or re-adopted, their LMCache servers, its own record of the
engines it launched (`owned`), their ports and their keys. A launch, a park, a wake, a stop and
the death watch each move an instance's record through the instance store's compare-and-set
(`Holdings.move`, which also keeps the engine's last log lines in Redis), and end an instance
the same way: its processes gone first (its LMCache server after the engine), then its port
and key released, then the record (`fail`, `stop_finish`); memory is released only once the
processes are proven gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from capycommon.domain import commands as hc
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.service import REDIS_ERRORS
from capycommon.state.memory import MemoryStore
from capycommon.state.store import InstanceStore
from capyctl_hostd import engines, procs, release
from capyctl_hostd.cacheserver import CacheServers
from capyctl_hostd.engines import Engine
from capyctl_hostd.owned import OwnedEngine, OwnedEngines
from capyctl_hostd.ports import PortLeaser

log = logging.getLogger(__name__)
S = InstanceState
LOG_LINES_IN_REDIS = 50


@dataclass
class Holdings:
    """The engines and LMCache servers hostd holds, by member, its own record of the engines
    it launched, and their ports and keys (in `store`)."""

    store: InstanceStore
    ports: PortLeaser
    owned: OwnedEngines
    caches: CacheServers
    runtime_dir: Path
    # memwatch's readings, where a stop waits to see its engine's memory released.
    memory: MemoryStore | None = None
    engines: dict[str, Engine] = field(default_factory=dict)
    # Set when an engine is spawned, for the death watch to follow its leader at once.
    spawned: asyncio.Event = field(default_factory=asyncio.Event)

    async def move(
        self,
        record: InstanceRecord,
        state: InstanceState,
        reason: str,
        *,
        keep_log: bool = True,
        engine_s: float | None = None,
        **changes: object,
    ) -> InstanceRecord:
        """Move the record to `state`, then keep the engine's last log lines in Redis, unless
        `keep_log` is False: a park or wake under way keeps them at its next state, and its
        engine call starts sooner. `engine_s`: the engine's own part of the step's time."""
        written = await self.store.move(record, state, reason, engine_s, **changes)
        if keep_log:
            await self._publish_log(written)
        return written

    async def _publish_log(self, record: InstanceRecord) -> None:
        if record.log_path is None:
            return
        lines = engines.tail(Path(record.log_path), LOG_LINES_IN_REDIS)
        await self.store.publish_log(record.deployment, record.instance, lines)

    async def refuse_command(
        self, command: hc.Launch | hc.Park | hc.Wake | hc.Stop | hc.Abort, why: str
    ) -> None:
        log.warning(
            "refused %s of %s:%s: %s", command.kind, command.deployment, command.instance, why
        )
        await self.store.refused(
            command.deployment,
            command.instance,
            command.generation,
            f"{command.kind} refused: {why}",
        )

    async def refuse_record(self, record: InstanceRecord, kind: str, why: str) -> None:
        await self.store.refused(
            record.deployment, record.instance, record.generation, f"{kind} refused: {why}"
        )

    def own(self, record: InstanceRecord) -> None:
        """Note the engine `record` names in hostd's own record of the engines it holds."""
        entry = OwnedEngine.of(record, self.runtime_dir)
        if entry is not None:
            self.owned.keep(entry)

    async def fail(self, record: InstanceRecord, error: str) -> None:
        """Tear the launch down, then record the failure: memory is released only once the
        processes are proven gone."""
        log.error("%s: %s", record.member, error)
        await self.tear_down(record)
        if record.log_path is not None:  # after every line of the engine's own
            reason = error.split("; last log lines:", 1)[0]
            engines.end_log(Path(record.log_path), f"capyctl: {reason}; its processes are gone")
        await self.move(record, S.FAILED, error.split(";", 1)[0], error=error, cache=None)

    async def stop_finish(
        self, record: InstanceRecord, reason: str, keep_cache: bool = False
    ) -> None:
        """From stopping: processes gone (its LMCache server after the engine, unless
        `keep_cache`), port and key released, then stopped."""
        segments = await self.tear_down(record, keep_cache)
        kept = self.caches.servers.get(record.member) if keep_cache else None
        await self.move(
            record,
            S.STOPPED,
            f"stopped: {reason}" + ("; its LMCache server is kept" if kept else ""),
            shm_segments=tuple(segments),
            cache=None if kept is None else kept.record,
        )

    async def tear_down(self, record: InstanceRecord, keep_cache: bool = False) -> list[str]:
        """The instance's processes gone (its LMCache server after the engine, unless
        `keep_cache`), its port and key released; the /dev/shm segments removed."""
        engine = self.engines.pop(record.member, None)
        removed: list[str] = []
        pgid = engine.pgid if engine is not None else None
        if pgid is None and record.process is not None:
            pgid = record.process.pgid
        pids = {pgid, *procs.group_members(pgid)} if pgid is not None else set()
        if engine is not None:
            removed = await engines.tear_down(engine)
        elif record.process is not None and procs.group_members(record.process.pgid):
            await procs.stop_group(record.process.pgid)
        await self._released(record, pids, time.time())
        if not keep_cache:  # after the engine: it holds the server's memory mapped
            await self.caches.stop_member(record.member, "its engine stopped")
        self.owned.drop(record.member)
        self.ports.release(record.port)
        await self.store.drop_secret(record.deployment, record.instance)
        return removed

    async def forget_cache(self, record: InstanceRecord, why: str) -> InstanceRecord:
        """A stopped instance whose kept LMCache server is gone (or stopped now): its server
        stopped, then its record without it, so it is charged no more."""
        await self.caches.stop_member(record.member, why)
        return await self.move(record, record.state, f"LMCache server stopped: {why}", cache=None)

    async def _released(self, record: InstanceRecord, pids: set[int], since: float) -> None:
        """Wait for memwatch to show none of the engine's processes on any of its GPUs; say
        so when it still does (the processes are gone: the stop goes on)."""
        if self.memory is None:
            return
        with contextlib.suppress(*REDIS_ERRORS):  # memwatch's word is lost with Redis
            held = await release.cleared(self.memory, record, pids, since)
            if held is not None:
                log.warning(
                    "%s: its processes are gone, and memwatch still shows them on %s",
                    record.member,
                    held,
                )

    async def stop_uncounted(self, entry: OwnedEngine, record: InstanceRecord | None) -> None:
        """Stop an engine that `record` (its instance's record, if any) does not count, and
        clean what it left as a reap does: its memory would be held with nothing charging it,
        and a redeploy would start a second copy beside it. Its entry goes last, once the
        rest is done."""
        engine = self.engines.pop(entry.member, None)
        running = bool(procs.group_members(entry.process.pgid))
        if engine is not None:
            await engines.tear_down(engine)
        else:
            await engines.tear_down_group(entry.process.pgid, Path(entry.runtime_dir))
        self.ports.release(entry.port)
        if running:
            why = entry.why_uncounted(record)
            log.warning("%s: launch %s: %s", entry.member, entry.launch_id, why)
            if entry.log_path is not None:
                engines.end_log(Path(entry.log_path), f"capyctl: {why}; its processes are gone")
            with contextlib.suppress(*REDIS_ERRORS):  # the logs keep it if Redis is away
                await self.store.uncounted(entry.deployment, entry.instance, entry.generation, why)
        else:
            log.info("%s: launch %s is gone; its entry is dropped", entry.member, entry.launch_id)
        if record is None:  # the key of no other launch
            await self.store.drop_secret(entry.deployment, entry.instance)
        self.owned.drop(entry.member)
