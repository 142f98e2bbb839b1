"""Launching an instance: from the scheduler's launch command to its engine ready.

A launch reads top to bottom here. `Launcher.launch` refuses a stale command or a live
instance, stops an engine of the instance that no record counts, and resumes a launch that a
restart of hostd cut. `_launch` records the instance starting on a leased port, downloads its
model first when it comes from the Hub (before it takes the GPU: a download holds up no other
start there), then, one start at a time per GPU, `_spawn`s the engine and awaits it
(`_ready`), and records it ready.

`_start_engine` builds the engine's process: its profile from the host's engine registry
(`_checked_profile`, with the checks a launch must pass), the adapter's launch plan, the
LMCache server it connects to (`CacheServers.for_launch`), the closed environment, its
per-launch key, then `engines.spawn`. `_ready` probes its health every few tens of
milliseconds (`engines.wait_ready`), waits for its registration with its LMCache server, then
runs the first canary while the port check walks /proc beside it (`engines.first_canary`).

A stop of an engine that is still starting ends the launch's wait for it: the stop, queued
behind the launch, tears the engine down at once instead of after its start (minutes for a
large model that an operator stops or deletes while it loads). hostd's log line `started`
gives the moment each step ended (`steps`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from capycommon.deployments.resolve import check_head
from capycommon.domain import commands as hc
from capycommon.domain.engines import Residency
from capycommon.domain.instances import LIVE_STATES, InstanceRecord, InstanceState
from capycommon.engines import lmcache, registry
from capycommon.engines.adapters import adapter_for
from capycommon.engines.environment import engine_environment, install_runtime
from capycommon.engines.launch import LaunchPlan, LaunchSpec, host_tiers
from capycommon.engines.registry import EngineProfile
from capycommon.errors import CapyError, LaunchFailed
from capycommon.service import unless_stopped
from capycommon.state.store import Conflict
from capyctl_hostd import cacheserver, engines, modelfacts, procs
from capyctl_hostd.downloads import ModelStore
from capyctl_hostd.engines import Engine
from capyctl_hostd.holdings import Holdings
from capyctl_hostd.hostpaths import HostPaths
from capyctl_hostd.steps import Steps

log = logging.getLogger(__name__)
S = InstanceState

# What a launch command says that the instance record keeps.
RECORDED = {
    "deployment", "instance", "revision", "generation", "profile", "served_name", "model_path",
    "residency", "gpu_uuid", "gpu_uuids", "api",
}  # fmt: skip


@dataclass
class Launcher:
    host: str
    holdings: Holdings
    models: ModelStore
    paths: HostPaths
    # host.deep_park: off bars deep parking and the engines' development controls.
    deep_park: bool = True
    # host.engine_telemetry: allow leaves the engines' own usage reports as they are.
    telemetry: bool = False
    # host.retention: zero keeps no engine log and no core dump, unless a deployment says
    # retention: default.
    retention_zero: bool = False
    # The launch under way of each member: its generation, and the event a stop of that
    # generation sets.
    _starts: dict[str, tuple[int, asyncio.Event]] = field(default_factory=dict)
    _gpu_locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    async def launch(self, command: hc.Launch) -> None:
        current = await self.holdings.store.get(command.deployment, command.instance)
        if current is not None and self.cut_launch(current, command.generation):
            log.info("%s: resuming its launch, cut by a restart of hostd", current.member)
            await self._launch_on_gpu(command, current)
            return
        if current is not None and command.generation <= current.generation:
            await self.holdings.refuse_command(
                command,
                f"stale generation {command.generation}; the instance is at {current.generation}",
            )
            return
        if current is not None and current.state in LIVE_STATES:
            await self.holdings.refuse_command(
                command, f"the instance is {current.state}; stop it first"
            )
            return
        orphan = self.holdings.owned.entries.get(f"{command.deployment}:{command.instance}")
        if orphan is not None:  # never a second copy beside it
            await self.holdings.stop_uncounted(orphan, current)
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

    def cut_start(self, member: str, generation: int) -> None:
        """End the wait of the launch of `member` at `generation`, if one is under way."""
        start = self._starts.get(member)
        if start is not None and start[0] == generation:
            start[1].set()

    async def _launch_on_gpu(self, command: hc.Launch, current: InstanceRecord | None) -> None:
        gpus = GpuLocks(
            [self._gpu_locks.setdefault(uuid, asyncio.Lock()) for uuid in sorted(command.devices)]
        )
        if command.hub is not None:
            await self._launch(command, current, gpus)  # the GPUs are taken once downloaded
            return
        async with gpus:
            await self._launch(command, current, None)

    async def _launch(
        self, command: hc.Launch, current: InstanceRecord | None, gpu: GpuLocks | None
    ) -> None:
        """The instance starting: its model downloaded first when it comes from the Hub, then
        the engine spawned and awaited, holding its GPUs' locks (`gpu`, unless held already)."""
        steps = Steps()
        record = await self._record_starting(command, current)
        stopped = asyncio.Event()
        self._starts[record.member] = (record.generation, stopped)
        try:
            async with self.models.using(command.hub):
                if command.hub is not None:
                    # Before the GPU is taken: a download holds up no other start there.
                    store = await unless_stopped(self._download(command, command.hub), stopped)
                    if store is None:
                        log.info("%s: stopped while it downloaded", record.member)
                        return
                    steps.mark("downloaded")
                async with gpu or contextlib.nullcontext():
                    engine, record = await self._spawn(command, record, steps)
                    answer = await unless_stopped(
                        self._ready(engine, command.start_deadline_s, steps, record.member),
                        stopped,
                    )
        except (CapyError, OSError) as exc:
            await self.holdings.fail(record, f"launch failed: {_message(exc)}")
            return
        except Exception as exc:
            # A bug of ours: the record says so rather than stay starting for ever.
            log.exception("%s: the launch failed unexpectedly", record.member)
            await self.holdings.fail(record, f"launch failed: internal error: {exc!r}")
            return
        finally:
            del self._starts[record.member]
        if answer is None:
            log.info("%s: stopped while it started; the stop tears it down", record.member)
            return
        await self.holdings.move(
            record,
            S.READY,
            "ready: health and canary passed",
            canary=answer,
            engine_s=steps.between("spawned", "healthy"),
        )
        log.info("started", extra={"member": record.member, "steps": steps.marks})

    async def _record_starting(
        self, command: hc.Launch, current: InstanceRecord | None
    ) -> InstanceRecord:
        """The instance's record, moved to starting on a leased port under a new launch id
        (and its log's path, unless the launch keeps none)."""
        launch_id = f"{int(time.time() * 1000):x}-{secrets.token_hex(3)}"
        port = self.holdings.ports.lease()
        log_path = (
            None
            if self._zero_retention(command)
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
            return await self.holdings.store.transition(
                record,
                allowed=[current.state if current else "absent"],
                generation=current.generation if current else None,
                reason=f"launch: {command.reason}",
                previous=current,
            )
        except Conflict:
            self.holdings.ports.release(port)
            raise

    def _zero_retention(self, command: hc.Launch) -> bool:
        """Whether the launch keeps no engine log and no core dump: its deployment says
        retention: zero, or says nothing on a host whose retention is zero."""
        if command.retention is None:
            return self.retention_zero
        return command.retention == "zero"

    async def _download(self, command: hc.Launch, wanted: hc.HubPull) -> Path:
        """The model's store folder from the Hub; a failure names its code, for the
        scheduler to tell the waiting requests."""
        try:
            return await self.models.fetch(command.deployment, wanted)
        except CapyError as exc:
            raise exc.retold(f"download failed [{exc.code}]: {exc.message}") from None

    async def _spawn(
        self, command: hc.Launch, record: InstanceRecord, steps: Steps
    ) -> tuple[Engine, InstanceRecord]:
        """The engine's process started, and the record that says so."""
        log_path = None if record.log_path is None else Path(record.log_path)
        engine = await self._start_engine(command, record, log_path)
        steps.mark("spawned")
        server = self.holdings.caches.servers.get(record.member)
        started = record.model_copy(
            update={
                "process": procs.identity(engine.pgid),
                "fingerprint": engine.spec.profile.fingerprint,
                "family": engine.spec.profile.family.value,
                "version": engine.spec.profile.version,
                "cache": None if server is None else server.record,
            }
        )
        self.holdings.own(started)  # before Redis hears of it: a loss of Redis cannot hide it
        record = await self.holdings.store.transition(
            started,
            allowed=[S.STARTING],
            generation=record.generation,
            reason="engine process started",
            previous=record,
        )
        return engine, record

    async def _start_engine(
        self, command: hc.Launch, record: InstanceRecord, log_path: Path | None
    ) -> Engine:
        profiles = registry.read(self.paths.engines_file).document.profiles
        profile = await self._checked_profile(command, profiles)
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
            served_name=command.served_name,
            tuning=command.tuning(),
            api=command.api,
        )
        plan = adapter_for(profile.family).plan(spec)
        caches = self.holdings.caches
        server, writer = await caches.for_launch(command, record, log_path, secret, profiles)
        if server is not None:
            seed = lmcache.hash_seed(command.deployment, command.revision)
            argv, wiring = lmcache.engine_wiring(profile.family, server.ports, seed, runtime)
            plan = LaunchPlan([*plan.argv, *argv], {**plan.env, **wiring})
        env = {
            **command.env,
            **engine_environment(
                spec,
                plan,
                gpu_uuid=",".join(command.devices),
                home=self.paths.home,
                simgpu_dir=self.paths.simgpu_dir,
                telemetry=self.telemetry,
            ),
        }
        await self.holdings.store.keep_secret(command.deployment, command.instance, secret)
        engine = engines.spawn(spec, plan, env, log_path, secret, shared=writer)
        self.holdings.engines[record.member] = engine
        self.holdings.spawned.set()
        log.info(
            "launched", extra={"member": record.member, "pid": engine.pgid, "port": record.port}
        )
        return engine

    async def _checked_profile(
        self, command: hc.Launch, profiles: dict[str, EngineProfile]
    ) -> EngineProfile:
        """The engine profile the launch names, once the launch passes its checks: a decision
        model's head, and a residency this host allows."""
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
        return profile

    async def _ready(self, engine: Engine, deadline_s: float, steps: Steps, member: str) -> str:
        """Once the engine is ready (and registered with its LMCache server, if it has one)
        and passed its first canary, the canary's answer."""
        control = engine.control()
        await engines.wait_ready(engine, control, deadline_s)
        await control.confirm_api()
        steps.mark("healthy")
        server = self.holdings.caches.servers.get(member)
        if server is not None:
            await cacheserver.wait_registered(server)
            steps.mark("registered")
        answer = await engines.first_canary(engine, control)
        steps.mark("canary")
        return answer


def _message(exc: BaseException) -> str:
    return exc.message if isinstance(exc, CapyError) else str(exc)


class GpuLocks:
    """The start locks of every GPU of a launch's set, taken in UUID order (so two launches
    whose sets overlap never each hold a lock the other waits for) and released together."""

    def __init__(self, locks: list[asyncio.Lock]) -> None:
        self.locks = locks

    async def __aenter__(self) -> None:
        taken = []
        try:
            for lock in self.locks:
                await lock.acquire()
                taken.append(lock)
        except BaseException:
            for lock in reversed(taken):
                lock.release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        for lock in reversed(self.locks):
            lock.release()
