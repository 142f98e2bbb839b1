"""What a step of the check says: PASS, FAIL or SKIP on one line with its figures.

A step is a function that returns its figures (PASS), raises `Skip` with what this machine
lacks (SKIP: the step cannot say anything here) or `Fail` with what it saw instead of what
must hold (FAIL). Any other error of a step is that step's FAIL, its traceback on stderr: a
check runs to its end, so one broken step hides none of the others. The exit status is 1
when a step failed, else 0 (a machine without a GPU or torch passes with SKIP lines).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from capycommon.errors import CapyError

Status = Literal["PASS", "FAIL", "SKIP"]


class Skip(Exception):
    """The step cannot run on this machine; the message names what is missing."""


class Fail(Exception):
    """The step ran and what must hold did not; the message says what was seen."""


@dataclass(frozen=True)
class Outcome:
    number: int
    name: str
    status: Status
    text: str
    seconds: float

    def line(self) -> str:
        return f"{self.status} {self.number} {self.name}: {self.text} ({self.seconds:.1f} s)"


def run_step(number: int, name: str, body: Callable[[], str]) -> Outcome:
    """Run one step and say how it went."""
    started = time.monotonic()
    status: Status = "PASS"
    try:
        text = body()
    except Skip as exc:
        status, text = "SKIP", str(exc)
    except Fail as exc:
        status, text = "FAIL", str(exc)
    except CapyError as exc:
        status, text = "FAIL", f"error [{exc.code}]: {exc.message}"
    except Exception as exc:  # a step's own bug is its FAIL; the steps after it still run
        traceback.print_exc(file=sys.stderr)
        status, text = "FAIL", f"{type(exc).__name__}: {exc}"
    return Outcome(number, name, status, text, time.monotonic() - started)


def summary(outcomes: Sequence[Outcome], seconds: float) -> str:
    counts = {status: sum(o.status == status for o in outcomes) for status in ("PASS", "FAIL")}
    skipped = sum(o.status == "SKIP" for o in outcomes)
    return (
        f"gpu-check: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {skipped} SKIP "
        f"in {seconds:.0f} s"
    )


def exit_code(outcomes: Sequence[Outcome]) -> int:
    return 1 if any(o.status == "FAIL" for o in outcomes) else 0


def seconds(value: float) -> str:
    return f"{value:.1f} s"


def spread(values: Sequence[float], unit: str = "s", scale: float = 1.0) -> str:
    """`1.1-1.4 s`, or `1.0 s` when the values agree at that precision."""
    low, high = min(values) * scale, max(values) * scale
    digits = 0 if unit == "ms" else 1
    first, last = f"{low:.{digits}f}", f"{high:.{digits}f}"
    return f"{first} {unit}" if first == last else f"{first}-{last} {unit}"
