"""Choosing whom to release when a demanded model does not fit (a switch).

Victims go least recently used first; never one with requests in flight or waiting, nor a
warm or explicit deployment. Each victim parks when it can and its parked copy has room,
otherwise it stops. The fewest victims that make room are chosen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from capyctl_scheduler.ledger import InsufficientResources, Ledger


@dataclass(frozen=True)
class Candidate:
    owner: str
    last_used: float
    busy: bool  # requests in flight or waiting
    protected: bool  # lifecycle.warm or activation: explicit
    can_park: bool
    parked_charge: Mapping[str, int]


@dataclass(frozen=True)
class Release:
    owner: str
    action: Literal["park", "stop"]
    reason: str


def choose_victims(
    ledger: Ledger, owner: str, charge: Mapping[str, int], candidates: Sequence[Candidate]
) -> list[Release]:
    """The releases that make `charge` fit for `owner`, or InsufficientResources."""
    if not ledger.refusals(owner, charge):
        return []
    releases: list[Release] = []
    eligible = sorted(
        (c for c in candidates if c.owner != owner and not c.busy and not c.protected),
        key=lambda c: c.last_used,
    )
    start = ledger
    for victim in eligible:
        ledger, release = _release(ledger, victim)
        releases.append(release)
        if not ledger.refusals(owner, charge):
            return _fewest(start, owner, charge, eligible[: len(releases)])
    refusals = ledger.refusals(owner, charge)
    skipped = len(candidates) - len(eligible)
    raise InsufficientResources(
        "; ".join(str(r) for r in refusals)
        + (
            f" (after releasing every idle model; {skipped} busy, warm or explicit kept)"
            if skipped
            else ""
        )
    )


def _fewest(
    ledger: Ledger, owner: str, charge: Mapping[str, int], victims: Sequence[Candidate]
) -> list[Release]:
    """Drop, most recently used first, every victim the others make room without."""
    kept = list(victims)
    for victim in reversed(victims):
        trial = [v for v in kept if v is not victim]
        if _fits(ledger, owner, charge, trial):
            kept = trial
    released = []
    for victim in kept:
        ledger, release = _release(ledger, victim)
        released.append(release)
    return released


def _fits(
    ledger: Ledger, owner: str, charge: Mapping[str, int], victims: Sequence[Candidate]
) -> bool:
    for victim in victims:
        ledger, _ = _release(ledger, victim)
    return not ledger.refusals(owner, charge)


def _release(ledger: Ledger, victim: Candidate) -> tuple[Ledger, Release]:
    if victim.can_park and not ledger.refusals(victim.owner, victim.parked_charge):
        parked = ledger.admit(victim.owner, victim.parked_charge)
        return parked, Release(victim.owner, "park", "switch: least recently used")
    why = "cannot park" if not victim.can_park else "no room for its parked copy"
    return ledger.release(victim.owner), Release(victim.owner, "stop", f"switch: {why}")
