"""Choosing whom to release when a demanded model does not fit (a switch).

Victims go least recently used first; never one with requests in flight or waiting, nor a
warm or explicit deployment. Each victim parks when it can and its parked copy has room,
otherwise it stops. The fewest victims that make room are chosen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from capycommon.errors import InsufficientResources
from capyctl_scheduler.ledger import Ledger


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


Step = tuple[Candidate, Literal["park", "stop"]]


def choose_victims(
    ledger: Ledger, owner: str, charge: Mapping[str, int], candidates: Sequence[Candidate]
) -> list[Release]:
    """The releases that make `charge` fit for `owner`, or InsufficientResources.

    Victims are taken least recently used first, each parked when it can be. When parking
    every one of them still leaves too little (a first start whose peak nearly fills the
    card, say), their parks become stops, least recently used first, until it fits."""
    if not ledger.refusals(owner, charge):
        return []
    eligible = sorted(
        (c for c in candidates if c.owner != owner and not c.busy and not c.protected),
        key=lambda c: c.last_used,
    )
    steps: list[Step] = []
    for victim in eligible:
        steps.append((victim, "park" if victim.can_park else "stop"))
        if _fits(ledger, owner, charge, steps):
            return _fewest(ledger, owner, charge, steps)
    for index, (victim, action) in enumerate(steps):
        if action == "park":
            steps[index] = (victim, "stop")
            if _fits(ledger, owner, charge, steps):
                return _fewest(ledger, owner, charge, steps)
    refusals = _apply(ledger, steps)[0].refusals(owner, charge)
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
    ledger: Ledger, owner: str, charge: Mapping[str, int], steps: Sequence[Step]
) -> list[Release]:
    """Drop, most recently used first, every victim the others make room without; then turn
    back into parks the stops that can park and still leave room."""
    kept = list(steps)
    for step in reversed(steps):
        trial = [s for s in kept if s is not step]
        if _fits(ledger, owner, charge, trial):
            kept = trial
    for index in reversed(range(len(kept))):
        victim, action = kept[index]
        if action == "stop" and victim.can_park:
            trial = [*kept[:index], (victim, "park"), *kept[index + 1 :]]
            if _fits(ledger, owner, charge, trial):
                kept = trial
    return _apply(ledger, kept)[1]


def _fits(ledger: Ledger, owner: str, charge: Mapping[str, int], steps: Sequence[Step]) -> bool:
    return not _apply(ledger, steps)[0].refusals(owner, charge)


def _apply(ledger: Ledger, steps: Sequence[Step]) -> tuple[Ledger, list[Release]]:
    releases = []
    for victim, action in steps:
        ledger, release = _release(ledger, victim, action)
        releases.append(release)
    return ledger, releases


def _release(
    ledger: Ledger, victim: Candidate, action: Literal["park", "stop"]
) -> tuple[Ledger, Release]:
    if action == "park" and not ledger.refusals(victim.owner, victim.parked_charge):
        parked = ledger.admit(victim.owner, victim.parked_charge)
        return parked, Release(victim.owner, "park", "switch: least recently used")
    if action == "park":
        why = "no room for its parked copy"
    elif victim.can_park:
        why = "parking it would not free enough"
    else:
        why = "cannot park"
    return ledger.release(victim.owner), Release(victim.owner, "stop", f"switch: {why}")
