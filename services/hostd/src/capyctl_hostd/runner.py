"""Carrying out the scheduler's commands on this host, one at a time per instance.

Every change of state goes through the instance store's compare-and-set, so a command for a
stale generation, or one that arrives after the instance moved on, is refused and recorded.

A stop of an engine that is still starting ends the launch's wait for it: the stop, queued
behind the launch, tears the engine down at once instead of after its start (minutes for a
large model that an operator stops or deletes while it loads).

A wake or a start costs what the engine's own calls cost: a wake is the engine's wake calls,
then the canary as soon as they return; a start probes the engine's health every few tens of
milliseconds, then runs the canary while the port check walks /proc beside it. hostd's log
line for each (`woke`, `started`) gives the moment each step ended (`steps`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import socket
import subprocess
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis

from capycommon.deployments.resolve import check_head
from capycommon.engines import lmcache, registry
from capycommon.engines.adapters import adapter_for
from capycommon.engines.environment import engine_environment, install_runtime
from capycommon.engines.families import Family
from capycommon.engines.launch import LaunchPlan, LaunchSpec, Residency, host_tiers
from capycommon.engines.registry import EngineProfile
from capycommon.errors import CapyError, LaunchFailed
from capycommon.service import REDIS_ERRORS, until_stop
from capycommon.state import enginelogs
from capycommon.state import hostcommands as hc
from capycommon.state.instances import LIVE_STATES, InstanceRecord, InstanceState
from capycommon.state.memory import write_cache_server_rss
from capycommon.state.store import Conflict, InstanceStore
from capyctl_hostd import cacheserver, downloads, engines, modelfacts, procs, release
from capyctl_hostd.cacheserver import CacheServer
from capyctl_hostd.engines import Engine
from capyctl_hostd.owned import OwnedEngine, OwnedEngines
from capyctl_hostd.ports import PortLeaser
from capyctl_hostd.settle import Settler

log = logging.getLogger(__name__)
S = InstanceState
T = TypeVar("T")
LOG_LINES_IN_REDIS = 50

# What a launch command says that the instance record keeps, and what it says of the engine's
# tuning, passed to the adapter as it came.
RECORDED = {
    "deployment", "instance", "revision", "generation", "profile", "served_name", "model_path",
    "residency", "gpu_uuid", "api",
}  # fmt: skip
TUNING = {
    "served_name", "memory_fraction", "kv_cache_bytes", "context_length",
    "max_concurrent_requests", "tool_call_parser", "reasoning_parser", "extra_args", "api",
}  # fmt: skip


@dataclass
class HostPaths:
    engines_file: Path
    engines_record: Path  # hostd's own record of the engines it launched
    runtime_dir: Path
    logs_dir: Path
    home: Path
    simgpu_dir: Path | None
    models_root: Path  # where downloads from the Hub land, under sources/
    state_dir: Path  # for the Hub token file


@dataclass
class Runner:
    host: str
    client: aioredis.Redis
    store: InstanceStore
    ports: PortLeaser
    paths: HostPaths
    # host.deep_park: off bars deep parking and the engines' development controls.
    deep_park: bool = True
    # host.engine_telemetry: allow leaves the engines' own usage reports as they are.
    telemetry: bool = False
    # host.retention: zero keeps no engine log and no core dump, unless a deployment says
    # retention: default.
    retention_zero: bool = False
    engines: dict[str, Engine] = field(default_factory=dict)
    # The LMCache servers hostd holds, by member: beside a live engine, or kept through a
    # restart_only park.
    caches: dict[str, CacheServer] = field(default_factory=dict)
    # Set when an engine is spawned, for the death watch to follow its leader at once.
    spawned: asyncio.Event = field(default_factory=asyncio.Event)
    _member_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    _gpu_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    # The launch under way of each member: its generation, and the event a stop of that
    # generation sets.
    _starts: dict[str, tuple[int, asyncio.Event]] = field(default_factory=dict)
    settler: Settler = field(init=False)
    owned: OwnedEngines = field(init=False)
    kept: cacheserver.Kept = field(init=False)
    models: downloads.ModelStore = field(init=False)

    def __post_init__(self) -> None:
        self.settler = Settler(self.client, self.host)
        self.owned = OwnedEngines(self.paths.engines_record)
        self.kept = cacheserver.Kept(self.paths.engines_record.with_name("lmcache-servers.json"))
        self.models = downloads.ModelStore(
            self.host, self.client, self.store, self.paths.models_root, self.paths.state_dir
        )

    def lock_for(self, member: str) -> asyncio.Lock:
        return self._member_locks.setdefault(member, asyncio.Lock())

    async def handle(self, command: hc.Launch | hc.Park | hc.Wake | hc.Stop | hc.Abort) -> None:
        member = f"{command.deployment}:{command.instance}"
        if isinstance(command, hc.Stop):
            self._cut_start(member, command.generation)
        async with self.lock_for(member):
            try:
                await self._dispatch(command)
            except Conflict as exc:
                now = exc.current.state if exc.current else "absent"
                await self._refuse(command, f"the instance moved on (now {now})")

    async def _dispatch(self, command: hc.Launch | hc.Park | hc.Wake | hc.Stop | hc.Abort) -> None:
        if isinstance(command, hc.Launch):
            await self.launch(command)
            return
        record = await self._current(command)
        if record is None:
            return
        if isinstance(command, hc.Park):
            await self.park(record, command)
        elif isinstance(command, hc.Wake):
            await self.wake(record, command)
        elif isinstance(command, hc.Stop):
            await self.stop(record, command.reason, command.keep_cache)
        else:
            await self.abort(record, command.request_id)

    def _cut_start(self, member: str, generation: int) -> None:
        """End the wait of the launch of `member` at `generation`, if one is under way."""
        start = self._starts.get(member)
        if start is not None and start[0] == generation:
            start[1].set()

    async def _refuse(
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

    async def _current(
        self, command: hc.Park | hc.Wake | hc.Stop | hc.Abort
    ) -> InstanceRecord | None:
        record = await self.store.get(command.deployment, command.instance)
        if record is None:
            await self._refuse(command, "no such instance on this host")
        elif record.generation != command.generation:
            await self._refuse(
                command,
                f"stale generation {command.generation}; the instance is at {record.generation}",
            )
        else:
            return record
        return None

    # Launch ------------------------------------------------------------------------------

    async def launch(self, command: hc.Launch) -> None:
        current = await self.store.get(command.deployment, command.instance)
        if current is not None and self.cut_launch(current, command.generation):
            log.info("%s: resuming its launch, cut by a restart of hostd", current.member)
            await self._launch_on_gpu(command, current)
            return
        if current is not None and command.generation <= current.generation:
            await self._refuse(
                command,
                f"stale generation {command.generation}; the instance is at {current.generation}",
            )
            return
        if current is not None and current.state in LIVE_STATES:
            await self._refuse(command, f"the instance is {current.state}; stop it first")
            return
        orphan = self.owned.entries.get(f"{command.deployment}:{command.instance}")
        if orphan is not None:  # never a second copy beside it
            await self.stop_uncounted(orphan, current)
        await self._launch_on_gpu(command, current)

    def cut_launch(self, record: InstanceRecord, generation: int) -> bool:
        """Whether `record` is a launch of `generation` that an earlier hostd began and never
        finished: starting, with no engine yet (cut while it downloaded or waited for the GPU),
        and not a launch of this hostd's."""
        return (
            record.state == S.STARTING
            and record.generation == generation
            and record.process is None
            and record.member not in self._starts
        )

    async def _launch_on_gpu(self, command: hc.Launch, current: InstanceRecord | None) -> None:
        gpu = self._gpu_locks.setdefault(command.gpu_uuid, asyncio.Lock())
        if command.hub is not None:
            await self._launch(command, current, gpu)  # the GPU is taken once downloaded
            return
        async with gpu:
            await self._launch(command, current, None)

    async def _launch(
        self, command: hc.Launch, current: InstanceRecord | None, gpu: asyncio.Lock | None
    ) -> None:
        """The instance starting: its model downloaded first when it comes from the Hub, then
        the engine spawned and awaited, holding the GPU's lock (`gpu`, unless held already)."""
        steps = Steps()
        launch_id = f"{int(time.time() * 1000):x}-{secrets.token_hex(3)}"
        port = self.ports.lease()
        log_path = (
            None
            if self.zero_retention(command)
            else self.paths.logs_dir / command.deployment / f"{launch_id}.log"
        )
        record = InstanceRecord(
            **command.model_dump(include=RECORDED),
            state=S.STARTING,
            since=time.time(),
            host=self.host,
            launch_id=launch_id,
            port=port,
            log_path=None if log_path is None else str(log_path),
        )
        try:
            record = await self.store.transition(
                record,
                allowed=[current.state if current else "absent"],
                generation=current.generation if current else None,
                reason=f"launch: {command.reason}",
                previous=current,
            )
        except Conflict:
            self.ports.release(port)
            raise
        stopped = asyncio.Event()
        self._starts[record.member] = (record.generation, stopped)
        try:
            async with self.models.using(command.hub):
                if command.hub is not None:
                    # Before the GPU is taken: a download holds up no other start there.
                    store = await _unless_stopped(self._download(command, command.hub), stopped)
                    if store is None:
                        log.info("%s: stopped while it downloaded", record.member)
                        return
                    steps.mark("downloaded")
                async with gpu or contextlib.nullcontext():
                    engine, record = await self._spawn(command, record, log_path, steps)
                    answer = await _unless_stopped(
                        self._ready(engine, command.start_deadline_s, steps, record.member),
                        stopped,
                    )
        except (CapyError, OSError) as exc:
            await self.fail(record, f"launch failed: {_message(exc)}")
            return
        except Exception as exc:
            # A bug of ours: the record says so rather than stay starting for ever.
            log.exception("%s: the launch failed unexpectedly", record.member)
            await self.fail(record, f"launch failed: internal error: {exc!r}")
            return
        finally:
            del self._starts[record.member]
        if answer is None:
            log.info("%s: stopped while it started; the stop tears it down", record.member)
            return
        await self._to(
            record,
            S.READY,
            "ready: health and canary passed",
            canary=answer,
            engine_s=steps.between("spawned", "healthy"),
        )
        log.info("started", extra={"member": record.member, "steps": steps.marks})

    async def _download(self, command: hc.Launch, wanted: hc.HubPull) -> Path:
        """The model's store folder from the Hub; a failure names its code, for the
        scheduler to tell the waiting requests."""
        try:
            return await self.models.fetch(command.deployment, wanted)
        except CapyError as exc:
            raise exc.retold(f"download failed [{exc.code}]: {exc.message}") from None

    def zero_retention(self, command: hc.Launch) -> bool:
        """Whether the launch keeps no engine log and no core dump: its deployment says
        retention: zero, or says nothing on a host whose retention is zero."""
        if command.retention is None:
            return self.retention_zero
        return command.retention == "zero"

    async def _spawn(
        self,
        command: hc.Launch,
        record: InstanceRecord,
        log_path: Path | None,
        steps: Steps,
    ) -> tuple[Engine, InstanceRecord]:
        """The engine's process started, and the record that says so."""
        engine = await self._start_engine(command, record, log_path)
        steps.mark("spawned")
        server = self.caches.get(record.member)
        started = record.model_copy(
            update={
                "process": procs.identity(engine.pgid),
                "fingerprint": engine.spec.profile.fingerprint,
                "family": engine.spec.profile.family.value,
                "cache": None if server is None else server.record,
            }
        )
        self.own(started)  # before Redis hears of it: a loss of Redis cannot hide it
        record = await self.store.transition(
            started,
            allowed=[S.STARTING],
            generation=record.generation,
            reason="engine process started",
            previous=record,
        )
        return engine, record

    async def _ready(self, engine: Engine, deadline_s: float, steps: Steps, member: str) -> str:
        """Once the engine is ready (and registered with its LMCache server, if it has one)
        and passed its first canary, the canary's answer."""
        control = engine.control()
        await engines.wait_ready(engine, control, deadline_s)
        await control.confirm_api()
        steps.mark("healthy")
        server = self.caches.get(member)
        if server is not None:
            await cacheserver.wait_registered(server)
            steps.mark("registered")
        answer = await engines.first_canary(engine, control)
        steps.mark("canary")
        return answer

    async def _start_engine(
        self, command: hc.Launch, record: InstanceRecord, log_path: Path | None
    ) -> Engine:
        profiles = registry.read(self.paths.engines_file).document.profiles
        profile = profiles.get(command.profile)
        if profile is None:
            raise LaunchFailed(
                f"no engine named {command.profile!r} is registered on host {self.host} "
                f"(registered: {', '.join(sorted(profiles)) or 'none'})"
            )
        capabilities = adapter_for(profile.family).capabilities(profile.version)
        if command.api == "decisions":  # a download's files are seen here first
            check_head(
                profile, await asyncio.to_thread(modelfacts.describe, Path(command.model_path))
            )
        if Residency(command.residency) not in host_tiers(capabilities, self.deep_park):
            raise LaunchFailed(
                f"residency {command.residency} needs deep parking or the engine's development "
                f"controls, and deep parking is off on host {self.host} (host.deep_park: off)"
            )
        secret = secrets.token_hex(32)  # 256 bits, and never a leading "-" on a command line
        assert record.launch_id is not None
        assert record.port is not None
        runtime = self.paths.runtime_dir / record.launch_id
        install_runtime(runtime)
        spec = LaunchSpec(
            profile=profile,
            model_path=Path(command.model_path),
            port=record.port,
            api_key=secret,
            residency=Residency(command.residency),
            runtime_dir=runtime,
            **command.model_dump(include=TUNING),
        )
        plan = adapter_for(profile.family).plan(spec)
        server, writer = await self._cache_for(command, record, log_path, secret, profiles)
        if server is not None:
            seed = lmcache.hash_seed(command.deployment, command.revision)
            argv, wiring = lmcache.engine_wiring(profile.family, server.ports, seed, runtime)
            plan = LaunchPlan([*plan.argv, *argv], {**plan.env, **wiring})
        env = {
            **command.env,
            **engine_environment(
                spec,
                plan,
                gpu_uuid=command.gpu_uuid,
                home=self.paths.home,
                simgpu_dir=self.paths.simgpu_dir,
                telemetry=self.telemetry,
            ),
        }
        await self.store.keep_secret(command.deployment, command.instance, secret)
        engine = engines.spawn(spec, plan, env, log_path, secret, shared=writer)
        self.engines[record.member] = engine
        self.spawned.set()
        log.info(
            "launched", extra={"member": record.member, "pid": engine.pgid, "port": record.port}
        )
        return engine

    async def _cache_for(
        self,
        command: hc.Launch,
        record: InstanceRecord,
        log_path: Path | None,
        secret: str,
        profiles: dict[str, EngineProfile],
    ) -> tuple[CacheServer | None, subprocess.Popen[bytes] | None]:
        """The LMCache server the engine connects to, healthy: the one a restart_only park
        kept, when it fits this launch, else one started now (with the launch's log writer,
        which the engine then shares). A kept server that does not fit is stopped first."""
        wanted = command.cache
        install = None if wanted is None else profiles.get(wanted.profile)
        held = self.caches.get(record.member)
        if held is not None and (
            install is None
            or wanted is None
            or not held.fits(install, command.revision, wanted.pool_bytes)
        ):
            await self.stop_cache(record.member, "it does not fit this launch")
            held = None
        if wanted is None:
            return None, None
        if install is None or install.family != Family.LMCACHE:
            raise LaunchFailed(
                f"no LMCache named {wanted.profile!r} is registered on host {self.host}"
            )
        if held is not None:
            await cacheserver.wait_healthy(held, cacheserver.REGISTERED_WITHIN_S)
            log.info("%s: connects to the LMCache server a park kept", record.member)
            return held, None
        assert log_path is not None, "retention: zero never starts LMCache"
        writer = engines.open_log(log_path, secret)
        ports = lmcache.ServerPorts(self.ports.lease(), self.ports.lease(), self.ports.lease())
        assert record.gpu_uuid is not None
        try:
            server = cacheserver.start(
                record.member,
                install,
                ports,
                command.revision,
                wanted.pool_bytes,
                (wanted.host_bytes, wanted.device_bytes),
                record.gpu_uuid,
                log_path,
                writer,
                self.paths.runtime_dir,
            )
        except BaseException:
            for port in (ports.zmq, ports.http, ports.metrics):
                self.ports.release(port)
            if writer.stdin is not None:
                writer.stdin.close()
            raise
        self.caches[record.member] = server
        self.kept.keep(server)
        await cacheserver.wait_healthy(server)
        rss = cacheserver.resident_bytes(server)
        if rss is not None:
            await write_cache_server_rss(self.client, self.host, install.fingerprint, rss)
        return server, writer

    async def forget_cache(self, record: InstanceRecord, why: str) -> InstanceRecord:
        """A stopped instance whose kept LMCache server is gone (or stopped now): its server
        stopped, then its record without it, so it is charged no more."""
        await self.stop_cache(record.member, why)
        return await self._to(record, record.state, f"LMCache server stopped: {why}", cache=None)

    async def stop_cache(self, member: str, why: str) -> CacheServer | None:
        """Stop the member's LMCache server, if hostd holds one; its ports come back."""
        server = self.caches.pop(member, None)
        if server is None:
            return None
        log.info("%s: stopping its LMCache server: %s", member, why)
        await cacheserver.stop(server)
        for port in (server.record.zmq_port, server.record.http_port, server.record.metrics_port):
            self.ports.release(port)
        self.kept.drop(member)
        return server

    # Park, wake, stop, abort ---------------------------------------------------------------

    async def park(self, record: InstanceRecord, command: hc.Park) -> None:
        """The engine's park call, then, when the scheduler sent a parked charge, memwatch's
        word that the memory is released; hostd logs when each step ended (`steps`)."""
        steps = Steps()
        if record.state not in (S.READY, S.DRAINING):
            await self._refuse_record(record, "park", f"the instance is {record.state}")
            return
        engine = self.engines.get(record.member)
        if engine is None:
            await self._refuse_record(record, "park", "hostd does not hold this engine")
            return
        record = await self._to(record, S.PARKING, f"park: {command.reason}", keep_log=False)
        residency = Residency(record.residency or Residency.RESTART_ONLY)
        control = engine.control()
        steps.mark("park call")
        try:
            await control.park(residency)
        except CapyError as exc:
            await self.fail(record, f"park failed: {exc.message}")
            return
        steps.mark("slept")
        if command.release_bound_bytes is None:
            engine_s = steps.between("park call", "slept")
            await self._to(record, S.PARKED, f"parked ({residency})", engine_s=engine_s)
        elif not await self._settle_park(
            record, engine.pgid, residency, command.release_bound_bytes, command.verify_s, steps
        ):
            return
        log.info("parked", extra={"member": record.member, "steps": steps.marks})

    async def _settle_park(
        self,
        record: InstanceRecord,
        pgid: int,
        residency: Residency,
        bound: int,
        verify_s: float,
        steps: Steps,
    ) -> bool:
        """Parked once memwatch shows the memory released (True); else stopped, so the
        scheduler's parked charge never stands for memory the engine still holds."""
        seen = await release.watch(self.client, record, pgid, bound, verify_s, since=time.time())
        released, reason = release.judge(seen, bound, verify_s, residency)
        if released:
            steps.mark("released")
            await self._to(record, S.PARKED, reason, engine_s=steps.between("park call", "slept"))
            return True
        log.error("%s: %s", record.member, reason)
        record = await self._to(record, S.STOPPING, reason)
        await self.stop_finish(record, reason)
        return False

    async def wake(self, record: InstanceRecord, command: hc.Wake) -> None:
        """The engine's wake calls, then the canary the moment they return: its answer, the
        same as at launch, is what lets requests through again."""
        steps = Steps()
        engine = self.engines.get(record.member)
        if record.state != S.PARKED or engine is None:
            await self._refuse_record(record, "wake", f"the instance is {record.state}")
            return
        record = await self._to(record, S.WAKING, f"wake: {command.reason}", keep_log=False)
        residency = Residency(record.residency or Residency.RESTART_ONLY)
        control = engine.control()
        steps.mark("wake call")
        try:
            async with asyncio.timeout(command.wake_deadline_s):
                await control.wake(residency)
                steps.mark("woke")
                engines.check_running(engine, "while waking")
                answer = await control.canary()
                steps.mark("canary")
        except TimeoutError:
            await self.fail(record, f"wake failed: not awake within {command.wake_deadline_s:g} s")
            return
        except CapyError as exc:
            await self.fail(record, f"wake failed: {exc.message}")
            return
        if record.canary is not None and answer != record.canary:
            await self.fail(
                record, f"wake_mismatch: the canary answered {answer!r}, not {record.canary!r}"
            )
            return
        await self._to(
            record,
            S.READY,
            "ready after wake: wake calls and canary passed",
            engine_s=steps.between("wake call", "woke"),
        )
        log.info("woke", extra={"member": record.member, "steps": steps.marks})

    async def stop(self, record: InstanceRecord, reason: str, keep_cache: bool = False) -> None:
        if record.state not in LIVE_STATES and record.cache is not None and not keep_cache:
            await self.forget_cache(record, reason)
            return
        if record.state not in LIVE_STATES:
            await self._refuse_record(record, "stop", f"the instance is already {record.state}")
            return
        record = await self._to(record, S.STOPPING, f"stop: {reason}")
        await self.stop_finish(record, reason, keep_cache)

    async def stop_finish(
        self, record: InstanceRecord, reason: str, keep_cache: bool = False
    ) -> None:
        """From stopping: processes gone (its LMCache server after the engine, unless
        `keep_cache`), port and key released, then stopped."""
        segments = await self._tear_down(record, keep_cache)
        kept = self.caches.get(record.member) if keep_cache else None
        await self._to(
            record,
            S.STOPPED,
            f"stopped: {reason}" + ("; its LMCache server is kept" if kept else ""),
            shm_segments=tuple(segments),
            cache=None if kept is None else kept.record,
        )

    async def abort(self, record: InstanceRecord, request_id: str) -> None:
        engine = self.engines.get(record.member)
        if engine is None:
            await self._refuse_record(record, "abort", "hostd does not hold this engine")
            return
        profile = engine.spec.profile
        if adapter_for(profile.family).capabilities(profile.version).abort_reports_end:
            self.settler.follow(engine, record, request_id)
            return
        try:
            await engine.control().abort(request_id)
        except CapyError as exc:
            await self._refuse_record(record, "abort", exc.message)

    async def tail_log(self, command: hc.TailLog) -> None:
        """Answer a request for the last lines of an instance's engine log: from its file, or
        from its writer's memory (retention: zero), on the request's reply channel."""
        record = await self.store.get(command.deployment, command.instance)
        tail = await asyncio.to_thread(self._tail, record, command.lines)
        await enginelogs.publish(self.client, self.host, command.reply, tail)

    def _tail(self, record: InstanceRecord | None, lines: int) -> enginelogs.LogTail:
        if record is None or record.launch_id is None:
            return enginelogs.LogTail(kept="none", lines=[], note="no engine was launched")
        if record.log_path is not None:
            found = engines.tail(Path(record.log_path), lines)
            return enginelogs.LogTail(kept="file", lines=found, launch_id=record.launch_id)
        where = engines.memory_log(self.paths.runtime_dir / record.launch_id)
        try:
            held = _read_socket(where)
        except OSError:
            return enginelogs.LogTail(
                kept="none",
                lines=[],
                launch_id=record.launch_id,
                note="its log was kept in memory only (retention: zero), and went with its engine",
            )
        found = engines.memory_tail(held, lines)
        return enginelogs.LogTail(kept="memory", lines=found, launch_id=record.launch_id)

    # Shared steps ----------------------------------------------------------------------------

    async def _to(
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
        new = record.model_copy(update={"state": state, "since": time.time(), **changes})
        written = await self.store.transition(
            new,
            allowed=[record.state],
            generation=record.generation,
            reason=reason,
            previous=record,
            engine_s=engine_s,
        )
        if keep_log:
            await self._publish_log(written)
        return written

    async def fail(self, record: InstanceRecord, error: str) -> None:
        """Tear the launch down, then record the failure: memory is released only once the
        processes are proven gone."""
        log.error("%s: %s", record.member, error)
        await self._tear_down(record)
        if record.log_path is not None:  # after every line of the engine's own
            reason = error.split("; last log lines:", 1)[0]
            engines.end_log(Path(record.log_path), f"capyctl: {reason}; its processes are gone")
        await self._to(record, S.FAILED, error.split(";", 1)[0], error=error, cache=None)

    async def _tear_down(self, record: InstanceRecord, keep_cache: bool = False) -> list[str]:
        engine = self.engines.pop(record.member, None)
        removed: list[str] = []
        if engine is not None:
            removed = await engines.tear_down(engine)
        elif record.process is not None and procs.group_members(record.process.pgid):
            await procs.stop_group(record.process.pgid)
        if not keep_cache:  # after the engine: it holds the server's memory mapped
            await self.stop_cache(record.member, "its engine stopped")
        self.owned.drop(record.member)
        self.ports.release(record.port)
        await self.store.drop_secret(record.deployment, record.instance)
        return removed

    def own(self, record: InstanceRecord) -> None:
        """Note the engine `record` names in hostd's own record of the engines it holds."""
        entry = OwnedEngine.of(record, self.paths.runtime_dir)
        if entry is not None:
            self.owned.keep(entry)

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

    async def _refuse_record(self, record: InstanceRecord, kind: str, why: str) -> None:
        await self.store.refused(
            record.deployment, record.instance, record.generation, f"{kind} refused: {why}"
        )

    async def _publish_log(self, record: InstanceRecord) -> None:
        if record.log_path is None:
            return
        lines = engines.tail(Path(record.log_path), LOG_LINES_IN_REDIS)
        await self.store.publish_log(record.deployment, record.instance, lines)


@dataclass
class Steps:
    """When each step of a start, park or wake ended (wall clock, from when hostd took it up),
    for hostd's log (where the time went) and its events (the engine's own part of it)."""

    marks: dict[str, float] = field(default_factory=lambda: {"received": _moment()})

    def mark(self, step: str) -> None:
        self.marks[step] = _moment()

    def between(self, first: str, last: str) -> float | None:
        """Seconds from one step's end to another's; None unless both were marked."""
        if first not in self.marks or last not in self.marks:
            return None
        return round(self.marks[last] - self.marks[first], 3)


async def _unless_stopped(work: Coroutine[Any, Any, T], stopped: asyncio.Event) -> T | None:
    """What `work` returns, or None once `stopped` is set before it is done (it is cancelled
    then)."""
    task = asyncio.ensure_future(work)
    try:
        await until_stop(task, stopped)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


def _moment() -> float:
    """Now, to a tenth of a millisecond, rounded down: a step's mark is never later than the
    record written right after it (its `since`)."""
    return math.floor(time.time() * 10_000) / 10_000


def _read_socket(path: Path) -> bytes:
    """Everything a memory log's writer sends on its socket (it closes when done)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(5.0)
        connection.connect(str(path))
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _message(exc: BaseException) -> str:
    return exc.message if isinstance(exc, CapyError) else str(exc)
