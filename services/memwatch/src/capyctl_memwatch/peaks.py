"""Measured startup peaks: the most a launch's process group held while it was starting.

`PeakSampler.tick(records, now)` is one step (every 500 ms in the service while a launch is
starting, and whenever hostd says an instance changed): it samples the process group of
every instance in `starting`, device and host bytes apart, keeping each maximum, and returns
a `StartupPeak` for each launch it saw become `ready`. The device figure is per GPU: the most
the group held on any one of its GPUs (an engine split over several GPUs is charged that on
each), never the sum over them. The clock and the meter are injected,
so the sampler is tested without processes or time passing.

Only a launch watched whole gets a figure: one that appeared in `starting` after the
sampler's first step, with no blind gap between steps since. A launch already starting when
memwatch (re)started, or one that went on while memwatch could not read the records, may
have peaked unseen; storing its figure as measured would understate the peak. Steps far
apart are no blind gap for a launch that appears after them when the caller followed hostd's
instance notifications throughout (`watched`): it stepped the moment the launch began.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.domain.memory import StartupPeak

log = logging.getLogger(__name__)

INTERVAL_S = 0.5
# Steps further apart than this leave a blind gap: launches then under way are not whole.
BLIND_AFTER_S = 2.0


@dataclass(frozen=True)
class GroupUse:
    """What one process group holds at one moment: `device_bytes` is the most it holds on
    any one GPU (an engine over several GPUs is charged that on each), `devices` how many
    GPUs it holds memory on, `host_bytes` its host RAM, `pids` its live members."""

    device_bytes: int
    host_bytes: int
    pids: int = 1
    devices: int = 1


class Meter(Protocol):
    def measure(self, pgids: Collection[int]) -> Mapping[int, GroupUse]: ...


@dataclass
class Launch:
    record: InstanceRecord
    whole: bool
    # The most the group held on one GPU, and in host RAM, at any sample.
    device_bytes: int = 0
    host_bytes: int = 0
    samples: int = 0
    # The most GPUs it held memory on at one sample.
    devices: int = 0

    def add(self, use: GroupUse) -> bool:
        """Count one sample; True when either maximum rose."""
        rose = use.device_bytes > self.device_bytes or use.host_bytes > self.host_bytes
        self.device_bytes = max(self.device_bytes, use.device_bytes)
        self.host_bytes = max(self.host_bytes, use.host_bytes)
        self.devices = max(self.devices, use.devices)
        self.samples += 1
        return rose


def _pgid(launch: Launch) -> int | None:
    return launch.record.process.pgid if launch.record.process is not None else None


def _state_of(record: InstanceRecord | None, launch: Launch) -> InstanceState | None:
    """The record's state while it is still this launch: the same engine process (PID and
    start time), so a relaunch is a new launch. None when it is gone or another launch."""
    if record is None or record.process is None or record.process != launch.record.process:
        return None
    return record.state


# A launch seen in any of these (with the same process) became ready since the last step,
# even if it has already moved on, e.g. straight to a park.
BECAME_READY = frozenset(
    {
        InstanceState.READY,
        InstanceState.DRAINING,
        InstanceState.PARKING,
        InstanceState.PARKED,
        InstanceState.WAKING,
    }
)


class PeakSampler:
    def __init__(self, host: str, meter: Meter, blind_after_s: float = BLIND_AFTER_S) -> None:
        self.host = host
        self.meter = meter
        self.blind_after_s = blind_after_s
        self.launches: dict[str, Launch] = {}
        self.last_step: float | None = None

    def tick(
        self, records: Iterable[InstanceRecord], now: float, watched: bool = False
    ) -> list[StartupPeak]:
        """One step over the host's instance records; the peaks of launches now ready.

        `watched`: no instance changed unannounced since the last step (the caller followed
        the host's notifications without a break), so a launch new at this step is whole
        however long ago that step was. A launch already under way is spoiled by any gap."""
        steady = self.last_step is not None and now - self.last_step <= self.blind_after_s
        seeing = steady or (watched and self.last_step is not None)
        self.last_step = now
        if not steady:
            for launch in self.launches.values():
                launch.whole = False
        current = {record.member: record for record in records}
        peaks = self._settle(current, now)
        for record in current.values():
            if record.state is InstanceState.STARTING and record.process is not None:
                self.launches.setdefault(record.member, Launch(record, whole=seeing))
        self._sample()
        return peaks

    def _settle(self, current: Mapping[str, InstanceRecord], now: float) -> list[StartupPeak]:
        """Forget launches that left `starting`; a peak for each that became ready."""
        peaks = []
        for member, launch in list(self.launches.items()):
            state = _state_of(current.get(member), launch)
            if state is InstanceState.STARTING:
                continue
            del self.launches[member]
            if state in BECAME_READY and (peak := self._peak(launch, now)) is not None:
                peaks.append(peak)
        return peaks

    def _sample(self) -> None:
        groups = {pgid for launch in self.launches.values() if (pgid := _pgid(launch))}
        uses = self.meter.measure(groups) if groups else {}
        for member, launch in self.launches.items():
            use = uses.get(_pgid(launch) or 0)
            if use is None or use.pids == 0:
                continue  # the group is gone; hostd will say what became of it
            if launch.add(use):
                log.debug(
                    "startup peak rose",
                    extra={
                        "member": member,
                        "device_bytes": launch.device_bytes,
                        "devices": launch.devices,
                        "host_bytes": launch.host_bytes,
                        "samples": launch.samples,
                    },
                )

    def _peak(self, launch: Launch, now: float) -> StartupPeak | None:
        """The launch's figure, or None (and why) when it is not one to keep."""
        record = launch.record
        if record.fingerprint is None:
            why = "the record has no engine fingerprint"
        elif launch.samples == 0:
            why = "no sample was taken while it started"
        elif not launch.whole:
            why = "it was already starting when memwatch began watching, or watching paused"
        else:
            return StartupPeak(
                deployment=record.deployment,
                revision=record.revision,
                host=self.host,
                fingerprint=record.fingerprint,
                device_bytes=launch.device_bytes,
                host_bytes=launch.host_bytes,
                measured_at=now,
                samples=launch.samples,
            )
        log.info("startup peak not stored", extra={"member": record.member, "reason": why})
        return None
