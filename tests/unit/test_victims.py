"""Victims of a switch: least recently used first, never busy, warm or explicit ones."""

from __future__ import annotations

from dataclasses import replace

import pytest

from capycommon.errors import InsufficientResources
from capyctl_scheduler.ledger import GiB, Ledger, derive_domains
from capyctl_scheduler.victims import Candidate, Release, choose_victims
from unit.readings import idle_reading

NEEDS = {"gpu0": 14 * GiB, "system": 4 * GiB}
PARKED = {"gpu0": GiB, "system": 4 * GiB}


def ledger_with(*owners: str) -> Ledger:
    reading = idle_reading((48 * GiB, False))
    ledger = Ledger({d.name: d for d in derive_domains(reading)})
    for owner in owners:
        ledger = ledger.admit(owner, NEEDS)
    return ledger


def candidate(owner: str, last_used: float, **changes: object) -> Candidate:
    values: dict[str, object] = {
        "owner": owner,
        "last_used": last_used,
        "busy": False,
        "protected": False,
        "can_park": True,
        "parked_charge": PARKED,
    }
    values.update(changes)
    return Candidate(**values)  # type: ignore[arg-type]


def abc(*changes: dict[str, object]) -> list[Candidate]:
    """Candidates a, b and c, last used at 1.0, 2.0 and 3.0, each with its `changes`."""
    return [
        candidate(owner, float(used), **changed)
        for used, (owner, changed) in enumerate(zip("abc", changes, strict=True), start=1)
    ]


def test_nothing_is_released_when_the_model_fits() -> None:
    assert choose_victims(ledger_with("a"), "new", NEEDS, [candidate("a", 1.0)]) == []


def test_the_least_recently_used_idle_model_parks() -> None:
    ledger = ledger_with("a", "b", "c")
    found = choose_victims(
        ledger, "new", NEEDS, [candidate("a", 30.0), candidate("b", 10.0), candidate("c", 20.0)]
    )
    assert found == [Release("b", "park", "switch: least recently used")]


def test_busy_warm_and_explicit_models_are_never_victims() -> None:
    ledger = ledger_with("a", "b", "c")
    candidates = abc({"busy": True}, {"protected": True}, {"can_park": False})
    assert choose_victims(ledger, "new", NEEDS, candidates) == [
        Release("c", "stop", "switch: cannot park")
    ]


def test_no_room_even_after_releasing_every_idle_model() -> None:
    ledger = ledger_with("a", "b", "c")
    candidates = abc({"busy": True}, {"busy": True}, {"protected": True})
    with pytest.raises(InsufficientResources, match=r"3 busy, warm or explicit kept"):
        choose_victims(ledger, "new", NEEDS, candidates)


def test_victims_stop_when_parking_them_would_not_free_enough() -> None:
    # The case: a 24 GiB card, one 6 GiB model ready, and a first start whose derived
    # peak (21.5 GiB) fits an empty card but not beside the other's parked residue.
    ledger = Ledger(ledger_with().domains)
    card = Ledger(
        {
            **ledger.domains,
            "gpu0": replace(
                ledger.domains["gpu0"],
                capacity=24 * GiB,
                managed_limit=22 * GiB,
                free_reserve=2 * GiB,
            ),
        }
    )
    card = card.admit("a", {"gpu0": 12 * GiB})
    peak = {"gpu0": 21 * GiB + GiB // 2}
    found = choose_victims(card, "new", peak, [candidate("a", 1.0, parked_charge={"gpu0": GiB})])
    assert found == [Release("a", "stop", "switch: parking it would not free enough")]


def test_only_as_many_parks_become_stops_as_needed() -> None:
    ledger = ledger_with("a", "b", "c")  # 48 GiB card: 44 GiB managed, 42 GiB charged
    big = {"gpu0": 42 * GiB, "system": 4 * GiB}
    candidates = [candidate("a", 1.0), candidate("b", 2.0), candidate("c", 3.0)]
    # Parking all three leaves 3 GiB of residue (41 GiB free): the least recently used stops.
    found = choose_victims(ledger, "new", big, candidates)
    assert [(r.owner, r.action) for r in found] == [("a", "stop"), ("b", "park"), ("c", "park")]
