"""After a restart of hostd: stop the engines that run with no record counting them (lost with
Redis's data), re-adopt the engines that still run, reap the dead ones, and keep watching for
engines that die or lose their records."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from capycommon.domain.commands import Launch
from capycommon.domain.engines import Residency
from capycommon.domain.instances import LIVE_STATES, InstanceRecord, InstanceState
from capycommon.engines import registry
from capycommon.engines.launch import LaunchSpec
from capycommon.service import REDIS_ERRORS, wait_any
from capycommon.state import hostcommands
from capycommon.state.store import Conflict
from capyctl_hostd import procs
from capyctl_hostd.engines import Engine, last_lines
from capyctl_hostd.holdings import Holdings
from capyctl_hostd.runner import Runner

log = logging.getLogger(__name__)
S = InstanceState
# The most commands taken and not finished that a restart looks through.
PENDING_READ = 1000
STABLE = (S.READY, S.DRAINING, S.PARKED)


async def adopt_all(runner: Runner) -> None:
    """First the engines of hostd's own record that no instance record counts (stopped, so
    their memory is released and a redeploy starts no second copy), then those Redis names.

    A launch the restart cut before its engine started (while its model downloaded, or while
    it waited for the GPU) is left starting when its command is among those the previous hostd
    took and never finished: the command, read again, resumes it (a download goes on from its
    partial files), so the cut costs no failed start."""
    records = {record.member: record for record in await runner.store.all()}
    await adopt_caches(runner.holdings, records)
    for entry in list(runner.holdings.owned.entries.values()):
        record = records.get(entry.member)
        if not entry.counted_by(record):
            await runner.holdings.stop_uncounted(entry, record)
    resumed = await _unfinished_launches(runner)
    for record in records.values():
        if record.state not in LIVE_STATES:
            continue
        if runner.launcher.cut_launch(record, resumed.get(record.member, -1)):
            log.info("%s: its launch was cut by a restart; its command resumes it", record.member)
            continue
        try:
            await adopt(runner, record)
        except Conflict:
            continue  # the record moved on while we looked


async def adopt_caches(holdings: Holdings, records: dict[str, InstanceRecord]) -> None:
    """Find again the LMCache servers the instance records name that still run; a kept one
    (a stopped instance's) that is gone stops being charged. Then stop every other server
    hostd's own record names: nothing counts it."""
    for member, record in records.items():
        cache = record.cache
        if cache is None:
            continue
        if procs.is_alive(cache.process):
            holdings.caches.found_again(member, cache)
        elif record.state not in LIVE_STATES:
            with contextlib.suppress(Conflict):
                records[member] = await holdings.forget_cache(record, "its LMCache server is gone")
    await holdings.caches.stop_unnamed()


async def _unfinished_launches(runner: Runner) -> dict[str, int]:
    """member -> generation of each launch command the previous hostd took and never
    finished (acknowledged)."""
    group = runner.state.commands.group(runner.host)
    await group.ensure()
    found: dict[str, int] = {}
    for _entry_id, fields in await group.read("0", count=PENDING_READ):
        # TypeError: an entry trimmed from the stream (`hostcommands.KEEP`) has no fields.
        with contextlib.suppress(KeyError, TypeError, ValidationError):
            command = hostcommands.parse(fields[hostcommands.FIELD.encode()])
            if isinstance(command, Launch):
                member = f"{command.deployment}:{command.instance}"
                found[member] = max(found.get(member, -1), command.generation)
    return found


async def adopt(runner: Runner, record: InstanceRecord) -> None:
    alive = record.process is not None and procs.is_alive(record.process)
    engine = await _rebuild(runner, record) if alive else None
    if engine is not None and record.state in STABLE:
        runner.holdings.engines[record.member] = engine
        runner.ports.hold(record.port or 0)
        runner.holdings.own(record)  # an engine launched before hostd kept its own record
        log.info("re-adopted", extra={"member": record.member, "pid": engine.pgid})
        return
    if engine is not None:
        # A start, park or wake was cut by the restart: its outcome is unknown, so stop it.
        runner.holdings.engines[record.member] = engine
        why = f"interrupted by a restart of hostd while {record.state}"
        await runner.lifecycle.stop(record, why)
        return
    await _reap(runner.holdings, record, "its engine is gone (found after a restart of hostd)")


async def _rebuild(runner: Runner, record: InstanceRecord) -> Engine | None:
    profile = registry.read(runner.paths.engines_file).document.profiles.get(record.profile or "")
    secret = await runner.store.secret(record.deployment, record.instance)
    if profile is None or secret is None or record.port is None or record.process is None:
        return None
    assert record.launch_id is not None
    spec = LaunchSpec(
        profile=profile,
        model_path=Path(record.model_path or ""),
        served_name=record.served_name or record.deployment,
        port=record.port,
        api_key=secret,
        residency=Residency(record.residency or Residency.RESTART_ONLY),
        runtime_dir=runner.paths.runtime_dir / record.launch_id,
        api=record.api,
    )
    return Engine(spec, record.process.pgid, Path(record.log_path or "/dev/null"))


async def _reap(holdings: Holdings, record: InstanceRecord, why: str) -> None:
    """The engine's leader is gone: clean what it left, then record the failure."""
    log.warning("%s: %s", record.member, why)
    if record.state == S.STOPPING:
        await holdings.stop_finish(record, why)
        return
    lines = last_lines(Path(record.log_path or os.devnull), "none")
    await holdings.fail(record, f"{why}; {lines}")


# How often the watch looks without being woken: for engines whose records Redis lost while
# hostd ran (a flush, a deleted append-only file), which nothing announces.
CHECK_S = 5.0


async def watch(runner: Runner, stop: asyncio.Event, interval_s: float = CHECK_S) -> None:
    """Notice engines that die on their own and record the failure: at once when an engine's
    leader exits (a pidfd per leader, whether hostd started it or re-adopted it, wakes the
    watch). Every `interval_s` too, stop the engines whose records Redis lost while hostd ran
    (and look at the leaders again)."""
    deaths = Deaths()
    try:
        while not stop.is_set():
            runner.holdings.spawned.clear()
            leaders = [engine.pgid for engine in runner.holdings.engines.values()]
            leaders += [server.pgid for server in runner.holdings.caches.servers.values()]
            deaths.follow(leaders)
            deaths.exited.clear()
            with contextlib.suppress(*REDIS_ERRORS):  # back at the next turn, or hostd exits
                await _check(runner)
            # A launch wakes the watch too, so its engine's leader is followed from the start.
            await wait_any(deaths.exited, runner.holdings.spawned, stop, timeout=interval_s)
    finally:
        deaths.close()


class Deaths:
    """A pidfd per engine leader: readable the moment the process exits, child of hostd or
    not, so the watch need not poll to learn it."""

    def __init__(self) -> None:
        self.exited = asyncio.Event()
        self._fds: dict[int, int] = {}

    def follow(self, pids: Iterable[int]) -> None:
        loop = asyncio.get_running_loop()
        wanted = set(pids)
        for pid in wanted - set(self._fds):
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # gone already: the check that follows sees it
                self.exited.set()
                continue
            self._fds[pid] = fd
            loop.add_reader(fd, self._exit, pid)
        for pid in set(self._fds) - wanted:
            self._drop(pid)

    def close(self) -> None:
        for pid in list(self._fds):
            self._drop(pid)

    def _exit(self, pid: int) -> None:
        self._drop(pid)
        self.exited.set()

    def _drop(self, pid: int) -> None:
        fd = self._fds.pop(pid)
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)


async def _check(runner: Runner) -> None:
    await _check_caches(runner)
    held = list(runner.holdings.engines.items())
    records = {r.member: r for r in await runner.store.get_many(member for member, _ in held)}
    for member, engine in held:
        record = records.get(member)
        entry = runner.holdings.owned.entries.get(member)
        if entry is not None and not entry.counted_by(record):
            await _stop_uncounted(runner, member)
        elif record is not None and record.state in STABLE and not _runs(engine, record):
            await _fail(runner, record, engine)


async def _check_caches(runner: Runner) -> None:
    """An LMCache server that died: a live instance fails (its engine holds mappings of the
    server's memory, and is started anew with a new server); a stopped one whose server a
    park kept stops being charged for it."""
    caches = runner.holdings.caches
    for member, server in list(caches.servers.items()):
        if server.alive():
            continue
        lock = runner.lock_for(member)
        if lock.locked():
            continue  # a command is under way; the next turn looks again
        async with lock:
            deployment, _, index = member.rpartition(":")
            record = await runner.store.get(deployment, int(index))
            if caches.servers.get(member) is not server:
                continue
            why = "its LMCache server exited on its own"
            with contextlib.suppress(Conflict):
                if record is not None and record.state in LIVE_STATES:
                    await runner.holdings.fail(record, f"{why}; see {server.record.log_path}")
                elif record is not None and record.cache is not None:
                    await runner.holdings.forget_cache(record, why)
                else:
                    await caches.stop_member(member, why)


def _runs(engine: Engine, record: InstanceRecord) -> bool:
    """The engine's leader runs: hostd's own child, or the re-adopted leader of the record
    (same PID and start time). Children that outlive their leader (vLLM's EngineCore) do not
    make an engine: the failure tears them down."""
    if engine.process is not None:
        return engine.exit_code() is None
    return record.process is not None and procs.is_alive(record.process)


async def _fail(runner: Runner, record: InstanceRecord, engine: Engine) -> None:
    async with runner.lock_for(record.member):
        code = engine.exit_code()
        why = f"the engine exited on its own (code {code}); {last_lines(engine.log_path, 'none')}"
        with contextlib.suppress(Conflict):
            await runner.holdings.fail(record, why)


async def _stop_uncounted(runner: Runner, member: str) -> None:
    """Stop the engine of `member` once no record counts it, unless a command for it is
    under way (it ends at its next write, and the next turn looks again)."""
    lock = runner.lock_for(member)
    if lock.locked():
        return
    async with lock:
        deployment, _, index = member.rpartition(":")
        record = await runner.store.get(deployment, int(index))
        entry = runner.holdings.owned.entries.get(member)
        if entry is not None and not entry.counted_by(record):
            await runner.holdings.stop_uncounted(entry, record)
