"""The moments a start, park or wake passed each of its steps."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


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


def _moment() -> float:
    """Now, to a tenth of a millisecond, rounded down: a step's mark is never later than the
    record written right after it (its `since`)."""
    return math.floor(time.time() * 10_000) / 10_000
