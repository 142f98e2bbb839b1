"""A role whose own data is damaged says so and stops, instead of restarting Redis and every
service in a loop: the error names the damaged file and a repair for its kind of damage, and
that repair, run as it is written, lets the role start again with the data that survives.
Here the incremental files (damagedstate.py says how); the manifest and the base file:
test_damaged_manifest.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from damagedstate import (
    AFTER,
    BEFORE,
    INCR,
    Damage,
    client,
    copy_of,
    overwrite,
    refused_then_repaired,
    split,
    tear,
)
from support import start_role

pytestmark = pytest.mark.slow


DAMAGE = {
    "a record unreadable in the last incremental file": Damage(
        lambda aof: overwrite(aof / INCR, 20),
        f"Bad file format reading the append only file {INCR}",
        (BEFORE,),
        (AFTER,),
    ),
    "a record unreadable in an earlier incremental file": Damage(
        lambda aof: overwrite(split(aof), 20), f"end the manifest at {INCR}", (BEFORE,), (AFTER,)
    ),
    "a missing incremental file": Damage(
        lambda aof: (aof / INCR).unlink(), f"list the files without {INCR}", (BEFORE,), (AFTER,)
    ),
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_damage_stops_the_role_with_a_repair_that_works(saved: Path, damage: Damage) -> None:
    refused_then_repaired(saved, damage)


TORN = {
    "at the end of the last incremental file": lambda aof: tear(aof / INCR),
    "at the end of an earlier incremental file": lambda aof: tear(split(aof)),
    # Redis cuts the torn record and exits, then cuts the open transaction and exits again.
    "inside a transaction at the end of an earlier file": lambda aof: tear(split(aof, True)),
}


@pytest.mark.parametrize("torn", TORN.values(), ids=TORN.keys())
def test_a_torn_last_record_is_no_damage(saved: Path, torn: Callable[[Path], None]) -> None:
    """A crash mid-write leaves a file's last record cut short: Redis cuts it off and loads
    the rest, at once or at a later start (an earlier file: it exits after each cut)."""
    with copy_of(saved) as state:
        torn(state / "redis" / "appendonly")
        role = start_role(state_dir=state)
        with client(state) as redis_client:
            assert redis_client.exists(BEFORE) == 1
        assert role.stop() == 0
