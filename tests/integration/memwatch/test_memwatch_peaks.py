"""The startup-peak sampler, driven step by step with a fake clock and a scripted meter."""

from __future__ import annotations

from collections.abc import Collection

import pytest

from capycommon.domain.instances import InstanceState, ProcessIdentity
from capycommon.domain.memory import StartupPeak
from capyctl_memwatch.peaks import GroupUse, PeakSampler
from integration.memwatch.helpers import GIB, record

STARTING, READY = InstanceState.STARTING, InstanceState.READY
ENGINE = ProcessIdentity(pid=4242, pgid=4242, start_ticks=1000)
RELAUNCH = ProcessIdentity(pid=5151, pgid=5151, start_ticks=2000)
MIB = 1 << 20


class ScriptedMeter:
    """Answers what the test says each process group holds now, and counts the calls."""

    def __init__(self) -> None:
        self.now: dict[int, GroupUse] = {}
        self.asked: list[set[int]] = []

    def measure(self, pgids: Collection[int]) -> dict[int, GroupUse]:
        self.asked.append(set(pgids))
        return {pgid: self.now.get(pgid, GroupUse(0, 0, pids=0)) for pgid in pgids}


@pytest.fixture
def meter() -> ScriptedMeter:
    return ScriptedMeter()


@pytest.fixture
def sampler(meter: ScriptedMeter) -> PeakSampler:
    return PeakSampler("local", meter)


def run(sampler: PeakSampler, meter: ScriptedMeter, uses: list[tuple[int, int]]) -> float:
    """Watch from t=99.5, see a launch at t=100, take one sample per use, 0.5 s apart."""
    assert sampler.tick([], 99.5) == []
    now = 100.0
    for device, host in uses:
        meter.now[ENGINE.pgid] = GroupUse(device, host, pids=2)
        assert sampler.tick([record(STARTING, ENGINE, since=99.9)], now) == []
        now += 0.5
    return now


def assert_ready_stores_nothing(
    sampler: PeakSampler, samples: int, since: float, now: float
) -> None:
    """The launch under way has taken `samples` samples, and seen ready (since `since`) at
    `now` it stores no peak."""
    assert sampler.launches["chat:0"].samples == samples
    assert sampler.tick([record(READY, ENGINE, since=since)], now) == []


def test_keeps_the_device_and_host_maxima_apart(sampler: PeakSampler, meter: ScriptedMeter) -> None:
    now = run(sampler, meter, [(1 * GIB, 300 * MIB), (6 * GIB, 100 * MIB), (4 * GIB, 900 * MIB)])
    meter.now[ENGINE.pgid] = GroupUse(20 * GIB, 20 * GIB)  # what ready holds is not the startup
    peaks = sampler.tick([record(READY, ENGINE, since=now)], now)
    assert peaks == [
        StartupPeak(
            deployment="chat",
            revision=3,
            host="local",
            fingerprint="fp-1",
            device_bytes=6 * GIB,
            host_bytes=900 * MIB,
            measured_at=now,
            samples=3,
        )
    ]
    assert peaks[0].provenance == "measured"
    assert sampler.launches == {}
    assert sampler.tick([record(READY, ENGINE, since=now)], now + 0.5) == [], "measured once"
    assert meter.asked == [{ENGINE.pgid}] * 3, "a ready instance is not sampled"


@pytest.mark.parametrize(
    "state", [InstanceState.FAILED, InstanceState.STOPPING, InstanceState.STOPPED]
)
def test_a_launch_that_does_not_become_ready_stores_nothing(
    sampler: PeakSampler, meter: ScriptedMeter, state: InstanceState
) -> None:
    now = run(sampler, meter, [(2 * GIB, 0)])
    assert sampler.tick([record(state, ENGINE, since=now)], now) == []
    assert sampler.launches == {}


def test_a_record_that_disappears_stores_nothing(
    sampler: PeakSampler, meter: ScriptedMeter
) -> None:
    now = run(sampler, meter, [(2 * GIB, 0)])
    assert sampler.tick([], now) == []
    assert sampler.launches == {}


def test_a_relaunch_is_measured_afresh(sampler: PeakSampler, meter: ScriptedMeter) -> None:
    now = run(sampler, meter, [(9 * GIB, 0)])
    meter.now[RELAUNCH.pgid] = GroupUse(2 * GIB, MIB)
    assert sampler.tick([record(STARTING, RELAUNCH, since=now)], now) == []
    (peak,) = sampler.tick([record(READY, RELAUNCH, since=now)], now + 0.5)
    assert (peak.device_bytes, peak.host_bytes, peak.samples) == (2 * GIB, MIB, 1)


def test_ready_with_another_process_is_not_this_launch(
    sampler: PeakSampler, meter: ScriptedMeter
) -> None:
    now = run(sampler, meter, [(9 * GIB, 0)])
    assert sampler.tick([record(READY, RELAUNCH, since=now)], now) == []


def test_a_launch_already_starting_at_the_first_step_is_not_stored(
    sampler: PeakSampler, meter: ScriptedMeter
) -> None:
    meter.now[ENGINE.pgid] = GroupUse(GIB, 0)
    sampler.tick([record(STARTING, ENGINE, since=99.9)], 100.0)
    sampler.tick([record(STARTING, ENGINE, since=99.9)], 100.5)
    assert_ready_stores_nothing(sampler, 2, since=100.7, now=101.0)


def test_a_blind_gap_spoils_the_launches_under_way(
    sampler: PeakSampler, meter: ScriptedMeter
) -> None:
    now = run(sampler, meter, [(GIB, 0)])
    # Records unreadable for 5 s (Redis lost): a peak may have come and gone unseen.
    sampler.tick([record(STARTING, ENGINE, since=99.9)], now + 5)
    assert sampler.tick([record(READY, ENGINE, since=now)], now + 5.5) == []
    # A launch first seen right after the gap is not whole either.
    meter.now[RELAUNCH.pgid] = GroupUse(GIB, 0)
    sampler.tick([record(STARTING, RELAUNCH, since=now)], now + 12)
    assert sampler.tick([record(READY, RELAUNCH, since=now)], now + 12.5) == []


def test_a_launch_announced_after_a_long_quiet_is_whole_but_one_under_way_is_not(
    sampler: PeakSampler, meter: ScriptedMeter
) -> None:
    # The service steps the moment hostd announces a change: with the announcements followed
    # throughout (watched), a launch new after a 60 s quiet was seen from its start.
    assert sampler.tick([], 40.0) == []
    meter.now[ENGINE.pgid] = GroupUse(2 * GIB, GIB, pids=2)
    assert sampler.tick([record(STARTING, ENGINE, since=99.99)], 100.0, watched=True) == []
    (peak,) = sampler.tick([record(READY, ENGINE, since=100.4)], 100.5, watched=True)
    assert (peak.device_bytes, peak.host_bytes, peak.samples) == (2 * GIB, GIB, 1)
    # Steps far apart while a launch is under way miss its samples, announced or not.
    meter.now[RELAUNCH.pgid] = GroupUse(GIB, 0)
    sampler.tick([record(STARTING, RELAUNCH, since=100.9)], 101.0, watched=True)
    sampler.tick([record(STARTING, RELAUNCH, since=100.9)], 110.0, watched=True)
    assert sampler.tick([record(READY, RELAUNCH, since=110.2)], 110.5, watched=True) == []
    # Without the announcements followed, a long quiet is a blind gap for a new launch too.
    sampler.tick([], 111.0)
    sampler.tick([record(STARTING, ENGINE, since=119.9)], 120.0)
    assert sampler.tick([record(READY, ENGINE, since=120.2)], 120.5) == []


def test_no_fingerprint_or_no_sample_stores_nothing(
    sampler: PeakSampler, meter: ScriptedMeter
) -> None:
    sampler.tick([], 99.5)
    sampler.tick([record(STARTING, ENGINE, since=99.9, fingerprint=None)], 100.0)
    assert sampler.tick([record(READY, ENGINE, since=100.2, fingerprint=None)], 100.5) == []
    # The group has no live member at the only step: no sample, no figure.
    sampler.tick([record(STARTING, ENGINE, since=99.9)], 100.0)
    assert_ready_stores_nothing(sampler, 0, since=100.2, now=100.5)


def test_records_without_a_process_are_not_watched(
    sampler: PeakSampler, meter: ScriptedMeter
) -> None:
    assert sampler.tick([record(STARTING, None, since=99.9)], 100.0) == []
    assert sampler.launches == {}
    assert meter.asked == []


def test_several_launches_are_sampled_in_one_measure(
    sampler: PeakSampler, meter: ScriptedMeter
) -> None:
    sampler.tick([], 99.5)
    meter.now = {ENGINE.pgid: GroupUse(GIB, 0), RELAUNCH.pgid: GroupUse(3 * GIB, 0)}
    both = [
        record(STARTING, ENGINE, since=99.9),
        record(STARTING, RELAUNCH, since=99.9, instance=1),
    ]
    sampler.tick(both, 100.0)
    assert meter.asked == [{ENGINE.pgid, RELAUNCH.pgid}]
    done = [record(READY, ENGINE, since=100.2), record(READY, RELAUNCH, since=100.2, instance=1)]
    peaks = sampler.tick(done, 100.5)
    assert sorted(p.device_bytes for p in peaks) == [GIB, 3 * GIB]


def test_a_launch_that_parks_before_the_next_step_still_counts(
    sampler: PeakSampler, meter: ScriptedMeter
) -> None:
    now = run(sampler, meter, [(2 * GIB, 100 * MIB), (6 * GIB, 200 * MIB)])
    peaks = sampler.tick([record(InstanceState.PARKING, ENGINE, since=now)], now)
    assert [(p.device_bytes, p.host_bytes) for p in peaks] == [(6 * GIB, 200 * MIB)]
