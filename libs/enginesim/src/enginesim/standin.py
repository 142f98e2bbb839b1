"""A host stand-in for scale: what a joined host's hostd and memwatch write to the server's
Redis, with no engine and no GPU behind it, light enough to run a hundred in one process.

It speaks the host protocol through the same state layer a real host uses, as the host's
own Redis user: its heartbeats (hostd's and memwatch's, every 3 s), a memory reading of its
simulated GPUs every 2 s, its info, models and engines at start, and its command stream
(group and consumer `hostd`, fenced by the scheduler's epoch, each entry acknowledged once
carried out). Launch, park, wake and stop move its instance records through the same
transitions with the same reasons, each step after a delay of the `Pace`; a ready engine's
load is published every second; a Describe is answered with the paths it names.

What it leaves out: engine processes and their ports' traffic (a ready record names a port
nobody serves), park verification against readings, downloads, LMCache, log tails and
aborts (acknowledged, nothing done). `tests/integration/test_standin_wire.py` compares what
it writes with a real hostd's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from capycommon.domain.commands import Describe, HostCommand, Launch, Park, Stop, Wake
from capycommon.domain.hosts import HOST_CAPABILITIES, EngineLoad, Heartbeat, HostInfo
from capycommon.domain.instances import InstanceRecord, InstanceState, ProcessIdentity
from capycommon.domain.memory import GpuReading, HostRam, MemoryReading
from capycommon.domain.models import HostModels, ModelFacts
from capycommon.engines.registry import EngineProfile, EnginesDocument, Registry
from capycommon.service import REDIS_ERRORS, wait_event
from capycommon.state import hostcommands
from capycommon.state.store import Conflict
from capycommon.state.stores import State
from capycommon.state.streams import Reader
from capycommon.tasks import cancel_and_wait
from capycommon.version import __version__
from enginesim import standin_steps

log = logging.getLogger(__name__)

GiB = 1024**3
HEARTBEAT_S = 3.0  # hostd's and memwatch's `heartbeats.INTERVAL_S`
READING_S = 2.0  # memwatch's `READING_INTERVAL_S`
LOAD_S = 1.0  # hostd's load tick while an engine serves
BLOCK_MS = 2000  # hostd's blocked read of its commands


# How long each step of an engine takes, in seconds: spawn (to its process), ready (to its
# health and canary), park, wake and stop. A plan's `pace` overrides any of them.
PACE = {"spawn": 0.2, "ready": 2.0, "park": 0.5, "wake": 0.5, "stop": 0.2}


@dataclass(frozen=True)
class HostPlan:
    """What one stand-in host is: its name, GPUs, RAM, the engine profiles it publishes and
    the weights of every model it holds (path -> bytes; any other path it is asked to
    describe has `default_weights`)."""

    name: str
    profiles: tuple[EngineProfile, ...]
    gpus: int = 8
    gpu_bytes: int = 80 * GiB
    ram_bytes: int = 1024 * GiB
    models_root: str = "/models"
    models: dict[str, int] = field(default_factory=dict)
    default_weights: int = 14 * GiB
    pace: Mapping[str, float] = field(default_factory=dict)

    def step_s(self, step: str) -> float:
        return self.pace.get(step, PACE[step])

    def gpu_uuid(self, index: int) -> str:
        return f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{self.name}.gpu{index}')}"


def facts(path: str, weights: int) -> ModelFacts:
    return ModelFacts(
        path=path,
        kind="folder",
        weights_bytes=weights,
        architectures=("LlamaForCausalLM",),
        dtype="bfloat16",
        attention_heads=32,
        kv_heads=8,
    )


class StandInHost:
    """One host's protocol on `state` (a client as the host's own Redis user)."""

    def __init__(self, state: State, plan: HostPlan) -> None:
        self.state = state
        self.plan = plan
        self.host = plan.name
        self.instances = state.instances(plan.name)
        self.started_at = time.time()
        # member -> its GPUs and the bytes it takes on each, on them or parked
        self.footprints: dict[str, tuple[tuple[str, ...], int]] = {}
        self.parked: dict[str, tuple[tuple[str, ...], int]] = {}
        self.described: dict[str, ModelFacts] = {}
        self.newest_epoch = 0
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Publish the host, then keep its heartbeats, readings, load and commands until
        `stop`; its heartbeats are removed then, as a stopping hostd removes its own."""
        await self._publish()
        loops = [
            self._every(HEARTBEAT_S, self._beat, stop),
            self._every(READING_S, self._read_memory, stop),
            self._every(LOAD_S, self._publish_load, stop),
            self._consume(stop),
        ]
        running = [asyncio.create_task(each) for each in loops]
        try:
            await stop.wait()
        finally:
            await cancel_and_wait(*running, *self._tasks)
            with contextlib.suppress(*REDIS_ERRORS):
                for service in ("hostd", "memwatch"):
                    await self.state.heartbeats.clear(self.host, service, os.getpid())

    async def _publish(self) -> None:
        info = HostInfo(
            version=__version__,
            capabilities=HOST_CAPABILITIES,
            deep_park=False,
            lmcache=False,
        )
        await self.state.host_info.publish(self.host, info)
        await self._publish_models()
        document = EnginesDocument(profiles={p.name: p for p in self.plan.profiles})
        registry = Registry(path=Path("/standin/engines.yaml"), revision=1, document=document)
        await self.state.engines.publish(self.host, registry)
        await self._beat()
        await self._read_memory()

    async def _publish_models(self) -> None:
        root = self.plan.models_root
        listed = {name: facts(f"{root}/{name}", size) for name, size in self.plan.models.items()}
        models = HostModels(models_root=root, models=listed, described=self.described)
        await self.state.host_models.publish(self.host, models)

    async def _every(
        self, period: float, step: Callable[[], Awaitable[None]], stop: asyncio.Event
    ) -> None:
        while not stop.is_set():
            try:
                await step()
            except REDIS_ERRORS as exc:
                log.debug("%s: %s", self.host, exc)
            await wait_event(stop, period)

    async def _beat(self) -> None:
        now = time.time()
        for service in ("hostd", "memwatch"):
            beat = Heartbeat(
                service=service,
                pid=os.getpid(),
                version=__version__,
                started_at=self.started_at,
                last_seen=now,
            )
            await self.state.heartbeats.beat(self.host, beat)

    async def _read_memory(self) -> None:
        used: dict[str, int] = {}
        for devices, size in self.footprints.values():
            for device in devices:
                used[device] = used.get(device, 0) + size
        gpus = []
        for index in range(self.plan.gpus):
            device = self.plan.gpu_uuid(index)
            taken = min(used.get(device, 0), self.plan.gpu_bytes)
            gpus.append(
                GpuReading(
                    index=index,
                    uuid=device,
                    name="NVIDIA H100 80GB HBM3 (stand-in)",
                    total_bytes=self.plan.gpu_bytes,
                    used_bytes=taken,
                    free_bytes=self.plan.gpu_bytes - taken,
                    unified=False,
                )
            )
        ram = HostRam(
            total_bytes=self.plan.ram_bytes,
            available_bytes=self.plan.ram_bytes // 2,
            source="simulated",
        )
        reading = MemoryReading(
            host=self.host, taken_at=time.time(), backend="simulated", gpus=gpus, ram=ram
        )
        await self.state.memory.write_reading(reading)

    async def _publish_load(self) -> None:
        records = await self.instances.all()
        now = time.time()
        serving = {
            r.member: EngineLoad(
                generation=r.generation, running=0, waiting=0, last_active_at=r.since, read_at=now
            )
            for r in records
            if r.state in (InstanceState.READY, InstanceState.DRAINING)
        }
        gone = [r.member for r in records if r.member not in serving]
        if serving or gone:
            draining = any(r.state == InstanceState.DRAINING for r in records)
            await self.state.loads.publish(self.host, serving, gone, notify=draining)

    async def _consume(self, stop: asyncio.Event) -> None:
        reader = Reader(self.state.commands.group(self.host))
        grouped = False
        while not stop.is_set():
            try:
                if not grouped:
                    await reader.group.ensure()
                    grouped = True
                entries = await reader.read(count=16, block_ms=BLOCK_MS)
            except REDIS_ERRORS as exc:
                log.debug("%s: commands: %s", self.host, exc)
                await wait_event(stop, 0.5)
                continue
            for entry_id, fields in entries:
                task = asyncio.create_task(self._carry_out(reader, entry_id, fields))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _carry_out(self, reader: Reader, entry_id: str, fields: dict[bytes, bytes]) -> None:
        try:
            command = hostcommands.parse(fields[hostcommands.FIELD.encode()])
        except (KeyError, ValueError) as exc:
            log.warning("%s: a malformed command: %s", self.host, exc)
        else:
            try:
                if await self._admitted(command, hostcommands.epoch_of(fields)):
                    await self._handle(command)
            except REDIS_ERRORS as exc:
                log.debug("%s: %s left unacknowledged: %s", self.host, command.kind, exc)
                return
        with contextlib.suppress(*REDIS_ERRORS):
            await reader.ack(entry_id)

    async def _admitted(self, command: HostCommand, epoch: int | None) -> bool:
        """hostd's fence: a launch, park, wake or stop from an older epoch is refused."""
        if not isinstance(command, Launch | Park | Wake | Stop):
            return True
        lease = max(self.newest_epoch, await self.state.leader.epoch() or 0)
        if (epoch is None and lease == 0) or (epoch is not None and epoch >= lease):
            self.newest_epoch = max(lease, epoch or 0)
            return True
        reason = (
            f"{command.kind} refused: sent with epoch {epoch} by a scheduler that no longer "
            f"holds the lease (now at epoch {lease})"
        )
        await self.instances.fenced(
            command.deployment, command.instance, command.generation, reason
        )
        return False

    async def _handle(self, command: HostCommand) -> None:
        if isinstance(command, Describe):
            self.described = {path: self._facts_of(path) for path in command.paths}
            await self._publish_models()
            return
        if not isinstance(command, Launch | Park | Wake | Stop):
            return  # abort, pull, remove, log tails: nothing stands behind them here
        member = f"{command.deployment}:{command.instance}"
        async with self._locks.setdefault(member, asyncio.Lock()):
            try:
                await standin_steps.step(self, command)
            except Conflict:
                current = await self.instances.get(command.deployment, command.instance)
                now = "absent" if current is None else current.state.value
                await self.refuse(command, f"the instance moved on (now {now})")

    def _facts_of(self, path: str) -> ModelFacts:
        return facts(path, self.plan.models.get(path, self.plan.default_weights))

    async def refuse(self, command: Launch | Park | Wake | Stop, why: str) -> None:
        reason = f"{command.kind} refused: {why}"
        await self.instances.refused(
            command.deployment, command.instance, command.generation, reason
        )

    async def refuse_record(self, record: InstanceRecord, kind: str, why: str) -> None:
        reason = f"{kind} refused: {why}"
        await self.instances.refused(record.deployment, record.instance, record.generation, reason)

    def process(self) -> ProcessIdentity:
        return ProcessIdentity(pid=os.getpid(), pgid=os.getpgid(0), start_ticks=1)
