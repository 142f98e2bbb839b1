"""Carrying out the scheduler's commands on this host, one at a time per instance.

`Runner.handle` takes each instance command under its instance's lock and hands it on: a
launch to the `Launcher` (`launch`: from the command to the ready engine), a park, wake, stop
or abort to the `Lifecycle` (`lifecycle`). Both work on what hostd holds (`Holdings`: the
engines, their LMCache servers, hostd's own record of them, their ports), and every change of
state goes through the instance store's compare-and-set, so a command for a stale generation,
or one that arrives after the instance moved on, is refused and recorded.

A stop of an engine that is still starting ends the launch's wait for it (`cut_start`), before
it queues behind the launch for the instance's lock.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import InitVar, dataclass, field
from pathlib import Path

from capycommon.domain import commands as hc
from capycommon.domain.hosts import LogTail
from capycommon.domain.instances import InstanceRecord
from capycommon.state.store import Conflict, InstanceStore
from capycommon.state.stores import State
from capyctl_hostd import engines
from capyctl_hostd.cacheserver import CacheServers
from capyctl_hostd.downloads import ModelStore
from capyctl_hostd.holdings import Holdings
from capyctl_hostd.hostpaths import HostPaths
from capyctl_hostd.launch import Launcher
from capyctl_hostd.lifecycle import Lifecycle
from capyctl_hostd.owned import OwnedEngines
from capyctl_hostd.ports import PortLeaser
from capyctl_hostd.settle import Settler


@dataclass
class Runner:
    host: str
    state: State
    store: InstanceStore
    ports: PortLeaser
    paths: HostPaths
    # The host's settings a launch follows (`Launcher`): host.deep_park, host.engine_telemetry
    # and host.retention.
    deep_park: InitVar[bool] = True
    telemetry: InitVar[bool] = False
    retention_zero: InitVar[bool] = False
    holdings: Holdings = field(init=False)
    models: ModelStore = field(init=False)
    launcher: Launcher = field(init=False)
    lifecycle: Lifecycle = field(init=False)
    _member_locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def __post_init__(self, deep_park: bool, telemetry: bool, retention_zero: bool) -> None:
        record = self.paths.engines_record
        caches = CacheServers(
            record.with_name("lmcache-servers.json"),
            self.ports,
            self.state,
            self.host,
            self.paths.runtime_dir,
        )
        self.holdings = Holdings(
            self.store,
            self.ports,
            OwnedEngines(record),
            caches,
            self.paths.runtime_dir,
            memory=self.state.memory,
        )
        self.models = ModelStore(
            self.host, self.state, self.store, self.paths.models_root, self.paths.state_dir
        )
        self.launcher = Launcher(
            self.host,
            self.holdings,
            self.models,
            self.paths,
            deep_park=deep_park,
            telemetry=telemetry,
            retention_zero=retention_zero,
        )
        self.lifecycle = Lifecycle(self.holdings, self.state, Settler(self.state, self.host))

    def lock_for(self, member: str) -> asyncio.Lock:
        return self._member_locks.setdefault(member, asyncio.Lock())

    async def handle(self, command: hc.Launch | hc.Park | hc.Wake | hc.Stop | hc.Abort) -> None:
        member = f"{command.deployment}:{command.instance}"
        if isinstance(command, hc.Stop):
            self.launcher.cut_start(member, command.generation)
        async with self.lock_for(member):
            try:
                await self._dispatch(command)
            except Conflict as exc:
                now = exc.current.state if exc.current else "absent"
                await self.holdings.refuse_command(command, f"the instance moved on (now {now})")

    async def _dispatch(self, command: hc.Launch | hc.Park | hc.Wake | hc.Stop | hc.Abort) -> None:
        if isinstance(command, hc.Launch):
            await self.launcher.launch(command)
            return
        record = await self._current(command)
        if record is None:
            return
        if isinstance(command, hc.Park):
            await self.lifecycle.park(record, command)
        elif isinstance(command, hc.Wake):
            await self.lifecycle.wake(record, command)
        elif isinstance(command, hc.Stop):
            await self.lifecycle.stop(record, command.reason, command.keep_cache)
        else:
            await self.lifecycle.abort(record, command.request_id)

    async def _current(
        self, command: hc.Park | hc.Wake | hc.Stop | hc.Abort
    ) -> InstanceRecord | None:
        record = await self.store.get(command.deployment, command.instance)
        if record is None:
            await self.holdings.refuse_command(command, "no such instance on this host")
        elif record.generation != command.generation:
            await self.holdings.refuse_command(
                command,
                f"stale generation {command.generation}; the instance is at {record.generation}",
            )
        else:
            return record
        return None

    async def tail_log(self, command: hc.TailLog) -> None:
        """Answer a request for the last lines of an instance's engine log: from its file, or
        from its writer's memory (retention: zero), on the request's reply channel."""
        record = await self.store.get(command.deployment, command.instance)
        tail = await asyncio.to_thread(self._tail, record, command.lines)
        await self.state.engine_logs.publish(self.host, command.reply, tail)

    def _tail(self, record: InstanceRecord | None, lines: int) -> LogTail:
        if record is None or record.launch_id is None:
            return LogTail(kept="none", lines=[], note="no engine was launched")
        if record.log_path is not None:
            found = engines.tail(Path(record.log_path), lines)
            return LogTail(kept="file", lines=found, launch_id=record.launch_id)
        where = engines.memory_log(self.paths.runtime_dir / record.launch_id)
        try:
            held = _read_socket(where)
        except OSError:
            return LogTail(
                kept="none",
                lines=[],
                launch_id=record.launch_id,
                note="its log was kept in memory only (retention: zero), and went with its engine",
            )
        found = engines.memory_tail(held, lines)
        return LogTail(kept="memory", lines=found, launch_id=record.launch_id)


def _read_socket(path: Path) -> bytes:
    """Everything a memory log's writer sends on its socket (it closes when done)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(5.0)
        connection.connect(str(path))
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)
