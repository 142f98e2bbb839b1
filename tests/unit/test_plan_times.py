"""The scheduler's tick times: percentiles over its window, written at most every
WRITE_EVERY_S."""

from __future__ import annotations

from capyctl_scheduler.plantimes import WINDOW, WRITE_EVERY_S, TickTimes


def test_percentiles_over_the_window() -> None:
    times = TickTimes()
    for ms in range(1, 101):  # 1 ms to 100 ms, 2 ms of CPU each
        times.add(ms / 1000, 0.002)
    found = times.summary("s", 10.0)
    assert (found.ticks, found.p50_ms, found.p99_ms, found.max_ms) == (100, 51.0, 100.0, 100.0)
    assert found.cpu_ms == 2.0
    for _ in range(WINDOW):  # the old ticks leave the window
        times.add(0.001, 0.001)
    assert times.summary("s", 11.0).max_ms == 1.0


def test_written_at_once_then_every_so_often() -> None:
    times = TickTimes()
    assert not times.due(100.0), "nothing to write before a tick"
    times.add(0.01, 0.01)
    assert times.due(100.0)
    assert not times.due(100.0 + WRITE_EVERY_S / 2)
    assert times.due(100.0 + WRITE_EVERY_S)
