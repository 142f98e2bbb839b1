"""What the scheduler's planning ticks cost, kept over a window of recent ticks and written
to Redis every WRITE_EVERY_S by the leader (`capyctl status` shows it; the fleet benchmark
reads it): the tick's time from its first read to its last write, percentiles over the
window, and the CPU time a tick takes on average."""

from __future__ import annotations

import time
from collections import deque

from capycommon.domain.leader import PlanTimes

WINDOW = 1000  # ticks
WRITE_EVERY_S = 10.0


class TickTimes:
    def __init__(self) -> None:
        self._ticks: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # wall s, CPU s
        self._written = 0.0

    def add(self, wall_s: float, cpu_s: float) -> None:
        self._ticks.append((wall_s, cpu_s))

    def due(self, now: float) -> bool:
        """Whether the summary is to be written now (and from now on, not for a while)."""
        if now - self._written < WRITE_EVERY_S or not self._ticks:
            return False
        self._written = now
        return True

    def summary(self, server: str, now: float) -> PlanTimes:
        walls = sorted(wall for wall, _ in self._ticks)
        count = len(walls)
        return PlanTimes(
            server=server,
            ticks=count,
            p50_ms=round(walls[count // 2] * 1000, 2),
            p99_ms=round(walls[min(count - 1, count * 99 // 100)] * 1000, 2),
            max_ms=round(walls[-1] * 1000, 2),
            cpu_ms=round(sum(cpu for _, cpu in self._ticks) / count * 1000, 2),
            at=now,
        )


class Stopwatch:
    """One tick's wall and CPU time."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu
