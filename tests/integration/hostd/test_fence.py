"""hostd refuses a launch, park, wake or stop sent under an epoch older than the scheduler
lease's: from a scheduler that lost its lease without knowing it (paused, cut off). The
refusal is recorded as `fenced`, apart from the refusals the current leader's effects wait
on, and nothing is carried out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capycommon.domain.commands import Stop
from capycommon.state import keys
from integration.hostd.harness import Hostd, launch
from support import holds_for, wait_for


def fenced(harness: Hostd) -> list[dict[str, Any]]:
    return [event for event in harness.events() if event["kind"] == "fenced"]


def test_a_deposed_schedulers_commands_are_refused(hostd: tuple[Hostd, str], model: Path) -> None:
    harness, gpu = hostd
    harness.client.set(keys.scheduler_epoch(), 2)  # the lease passed to a second scheduler
    harness.send(launch("a", 1, gpu, model), epoch=1)
    harness.send(launch("a", 1, gpu, model))  # none: a scheduler from before the lease
    refused = wait_for(lambda: len(fenced(harness)) == 2, timeout=20, what="two refusals")
    assert refused
    assert [e["reason"] for e in fenced(harness)] == [
        "launch refused: sent with epoch 1 by a scheduler that no longer holds the lease "
        "(now at epoch 2)",
        "launch refused: sent with no epoch by a scheduler that no longer holds the lease "
        "(now at epoch 2)",
    ]
    assert harness.record("a") is None, "nothing launched"
    assert not [e for e in harness.events() if e["kind"] == "refused"], "not a plain refusal"

    harness.send(launch("a", 1, gpu, model), epoch=2)
    harness.wait_state("a", "ready")
    # A leader newer than Redis's counter (its own write not read back yet) is taken at its
    # word, and the epoch it brought fences from then on.
    harness.send(Stop(deployment="a", generation=1), epoch=3)
    harness.wait_state("a", "stopped")
    harness.send(launch("a", 2, gpu, model), epoch=2)
    wait_for(lambda: len(fenced(harness)) == 3, timeout=20, what="a third refusal")
    holds_for(lambda: generation(harness) == 1, seconds=1, what="generation 2 never launched")


def generation(harness: Hostd) -> int | None:
    record = harness.record("a")
    return None if record is None else record.generation
