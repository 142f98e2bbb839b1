"""The stand-in host's engine lifecycle (`standin.py`): launch, park, wake and stop move an
instance's record through the states and reasons a real hostd writes, each step after its
time (`PACE`, or its plan's `pace`). A parked engine holds nothing on its GPUs here (a
host-backed park)."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING

from capycommon.domain.commands import Launch, Park, Stop, Wake
from capycommon.domain.instances import LIVE_STATES, InstanceRecord
from capycommon.domain.instances import InstanceState as S
from capycommon.domain.memory import StartupPeak

if TYPE_CHECKING:
    from enginesim.standin import StandInHost

# The launch's fields a record keeps (hostd's `launch.RECORDED`).
RECORDED = {
    "deployment", "instance", "revision", "generation", "profile", "served_name", "model_path",
    "residency", "gpu_uuid", "gpu_uuids", "api",
}  # fmt: skip
FIRST_PORT = 8100


async def step(host: StandInHost, command: Launch | Park | Wake | Stop) -> None:
    current = await host.instances.get(command.deployment, command.instance)
    if isinstance(command, Launch):
        await launch(host, command, current)
        return
    if current is None or current.generation != command.generation:
        at = "absent" if current is None else f"at generation {current.generation}"
        await host.refuse(command, f"the instance is {at}")
    elif isinstance(command, Park):
        await park(host, current, command.reason)
    elif isinstance(command, Wake):
        await wake(host, current, command.reason)
    else:
        await stop(host, current, command.reason)


async def launch(host: StandInHost, command: Launch, current: InstanceRecord | None) -> None:
    if current is not None and command.generation <= current.generation:
        reason = f"stale generation {command.generation}; the instance is at {current.generation}"
        await host.refuse(command, reason)
        return
    if current is not None and current.state not in (S.STOPPED, S.FAILED):
        await host.refuse(command, f"the instance is {current.state}; stop it first")
        return
    record = InstanceRecord(
        **command.model_dump(include=RECORDED),
        state=S.STARTING,
        since=time.time(),
        host=host.host,
        launch_id=f"{int(time.time() * 1000):x}-{secrets.token_hex(3)}",
        port=FIRST_PORT + command.instance,
    )
    record = await host.instances.transition(
        record,
        allowed=[current.state if current else "absent"],
        generation=current.generation if current else None,
        reason=f"launch: {command.reason}",
        previous=current,
    )
    size = _footprint(host, command)
    host.footprints[record.member] = (command.devices, size)
    await host.instances.keep_secret(command.deployment, command.instance, secrets.token_hex(32))
    await asyncio.sleep(host.plan.step_s("spawn"))
    profile = next((p for p in host.plan.profiles if p.name == command.profile), None)
    started = record.model_copy(
        update={
            "process": host.process(),
            "fingerprint": None if profile is None else profile.fingerprint,
            "family": None if profile is None else profile.family.value,
            "version": None if profile is None else profile.version,
        }
    )
    record = await host.instances.transition(
        started,
        allowed=[S.STARTING],
        generation=record.generation,
        reason="engine process started",
        previous=record,
    )
    await asyncio.sleep(host.plan.step_s("ready"))
    canary = secrets.token_hex(8)
    await host.instances.move(
        record,
        S.READY,
        "ready: health and canary passed",
        engine_s=host.plan.step_s("ready"),
        canary=canary,
    )
    await _measured(host, record, size)


async def _measured(host: StandInHost, record: InstanceRecord, size: int) -> None:
    """What memwatch measured of the start: its peak."""
    if record.fingerprint is None:
        return
    peak = StartupPeak(
        deployment=record.deployment,
        revision=record.revision,
        host=host.host,
        fingerprint=record.fingerprint,
        device_bytes=size,
        host_bytes=host.plan.ram_bytes // 1024,
        measured_at=time.time(),
        samples=int(host.plan.step_s("ready") / 0.5) + 1,
    )
    await host.state.memory.write_startup_peak(peak)


def _footprint(host: StandInHost, command: Launch) -> int:
    """The device bytes the engine takes on each of its GPUs."""
    if command.gpu_memory_bytes is not None:
        return command.gpu_memory_bytes
    return int(host.plan.gpu_bytes * (command.memory_fraction or 0.9))


async def park(host: StandInHost, record: InstanceRecord, reason: str) -> None:
    if record.state not in (S.READY, S.DRAINING):
        await host.refuse_record(record, "park", f"the instance is {record.state}")
        return
    record = await host.instances.move(record, S.PARKING, f"park: {reason}")
    await asyncio.sleep(host.plan.step_s("park"))
    devices, size = host.footprints.pop(record.member, ((), 0))
    host.parked[record.member] = (devices, size)
    await host.instances.move(
        record, S.PARKED, f"parked ({record.residency})", engine_s=host.plan.step_s("park")
    )


async def wake(host: StandInHost, record: InstanceRecord, reason: str) -> None:
    if record.state != S.PARKED:
        await host.refuse_record(record, "wake", f"the instance is {record.state}")
        return
    record = await host.instances.move(record, S.WAKING, f"wake: {reason}")
    host.footprints[record.member] = host.parked.pop(record.member, ((), 0))
    await asyncio.sleep(host.plan.step_s("wake"))
    await host.instances.move(
        record,
        S.READY,
        "ready after wake: wake calls and canary passed",
        engine_s=host.plan.step_s("wake"),
    )


async def stop(host: StandInHost, record: InstanceRecord, reason: str) -> None:
    if record.state not in LIVE_STATES:
        await host.refuse_record(record, "stop", f"the instance is already {record.state}")
        return
    record = await host.instances.move(record, S.STOPPING, f"stop: {reason}")
    await asyncio.sleep(host.plan.step_s("stop"))
    host.footprints.pop(record.member, None)
    host.parked.pop(record.member, None)
    await host.instances.drop_secret(record.deployment, record.instance)
    await host.instances.move(record, S.STOPPED, f"stopped: {reason}")
