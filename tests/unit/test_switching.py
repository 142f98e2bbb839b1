"""Victims of a switch: least recently used first, never busy, warm or explicit ones."""

from __future__ import annotations

import pytest

from capycommon.memory import GpuReading, HostRam, MemoryReading
from capyctl_scheduler.ledger import GiB, InsufficientResources, Ledger, derive_domains
from capyctl_scheduler.switching import Candidate, Release, choose_victims

NEEDS = {"gpu0": 14 * GiB, "system": 4 * GiB}
PARKED = {"gpu0": GiB, "system": 4 * GiB}


def ledger_with(*owners: str) -> Ledger:
    gpu = GpuReading(index=0, uuid="GPU-0", name="gpu0", total_bytes=48 * GiB,
                     used_bytes=0, free_bytes=48 * GiB, unified=False)  # fmt: skip
    reading = MemoryReading(
        host="local",
        taken_at=0.0,
        backend="simulated",
        gpus=[gpu],
        ram=HostRam(total_bytes=64 * GiB, available_bytes=64 * GiB, source="simulated"),
    )
    ledger = Ledger({d.name: d for d in derive_domains(reading)})
    for owner in owners:
        ledger = ledger.admit(owner, NEEDS)
    return ledger


def candidate(owner: str, last_used: float, **changes: object) -> Candidate:
    values: dict[str, object] = {
        "owner": owner, "last_used": last_used, "busy": False, "protected": False,
        "can_park": True, "parked_charge": PARKED,
    }  # fmt: skip
    values.update(changes)
    return Candidate(**values)  # type: ignore[arg-type]


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
    candidates = [
        candidate("a", 1.0, busy=True),
        candidate("b", 2.0, protected=True),
        candidate("c", 3.0, can_park=False),
    ]
    assert choose_victims(ledger, "new", NEEDS, candidates) == [
        Release("c", "stop", "switch: cannot park")
    ]


def test_no_room_even_after_releasing_every_idle_model() -> None:
    ledger = ledger_with("a", "b", "c")
    candidates = [
        candidate("a", 1.0, busy=True),
        candidate("b", 2.0, busy=True),
        candidate("c", 3.0, protected=True),
    ]
    with pytest.raises(InsufficientResources, match=r"3 busy, warm or explicit kept"):
        choose_victims(ledger, "new", NEEDS, candidates)
