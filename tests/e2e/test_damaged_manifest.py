"""A role whose Redis manifest or base file is damaged or missing stops with a repair for that
kind of damage, which, run as it is written, lets the role start again with the data that
survives (damagedstate.py says how; the incremental files: test_damaged_state.py). A manifest
gone while its files are there is refused before Redis starts: Redis would start empty."""

from __future__ import annotations

from pathlib import Path

import pytest

from damagedstate import (
    AFTER,
    BASE,
    BEFORE,
    MANIFEST,
    Damage,
    overwrite,
    refused_then_repaired,
)

pytestmark = pytest.mark.slow


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


DAMAGE = {
    "a damaged manifest": Damage(
        lambda aof: _append(aof / MANIFEST, "damaged\n"),
        "write the manifest anew from its files",
        (BEFORE, AFTER),
    ),
    "a missing manifest": Damage(
        lambda aof: (aof / MANIFEST).unlink(),
        f"manifest {{aof}}/{MANIFEST} is missing",
        (BEFORE, AFTER),
    ),
    "a missing base file": Damage(
        lambda aof: (aof / BASE).unlink(), f"list the files without {BASE}", (AFTER,), (BEFORE,)
    ),
    "a damaged base file": Damage(
        lambda aof: overwrite(aof / BASE, 90),
        f"list the files without {BASE}",
        (AFTER,),
        (BEFORE,),
    ),
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_damage_stops_the_role_with_a_repair_that_works(saved: Path, damage: Damage) -> None:
    refused_then_repaired(saved, damage)
