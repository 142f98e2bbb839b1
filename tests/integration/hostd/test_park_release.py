"""A park with a parked charge counts only once memwatch shows the device memory released;
otherwise hostd stops the instance and says why, with the figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capycommon.domain.commands import Park
from capycommon.units import format_size
from enginesim.behaviour import Faults
from enginesim.install import write_behaviour
from integration.hostd.harness import FAST, GiB, Hostd, launch
from support import group_members, wait_for

MiB = 1 << 20
BUDGET = 6 * GiB  # 0.25 of 24 GiB


def _transitions(harness: Hostd) -> list[dict[str, Any]]:
    return [e for e in harness.events() if e["kind"] == "transition"]


def test_a_park_counts_once_memwatch_sees_the_memory_released(
    hostd: tuple[Hostd, str], model: Path
) -> None:
    harness, gpu = hostd
    harness.start_memwatch()
    harness.send(launch("a", 1, gpu, model))
    harness.wait_state("a", "ready")
    harness.send(Park(deployment="a", generation=1, release_bound_bytes=GiB))
    parked = harness.wait_state("a", "parked", timeout=20)
    # The simulated engine keeps its 512 MiB residue (CUDA context, allocator pools).
    assert harness.device_bytes(parked)[0] == 512 * MiB
    last = _transitions(harness)[-1]
    assert (last["from_state"], last["to_state"]) == ("parking", "parked")
    assert last["reason"] == (
        "parked (host_backed): 512.0 MiB left on gpu0, within the 1.0 GiB parked charge"
    )

    harness.send(Park(deployment="a", generation=1, release_bound_bytes=GiB))
    refused = wait_for(
        lambda: [e["reason"] for e in harness.events() if e["kind"] == "refused"],
        timeout=10,
        what="the second park's refusal",
    )
    assert refused == ["park refused: the instance is parked"]


def test_a_park_that_keeps_the_memory_stops_the_instance(
    hostd: tuple[Hostd, str], model: Path, installs: dict[str, Path]
) -> None:
    harness, gpu = hostd
    keeps = FAST.model_copy(update={"faults": Faults(sleep_keeps_memory=True)})
    write_behaviour(installs["vllm"], keeps)
    harness.start_memwatch()
    harness.send(launch("a", 1, gpu, model))
    ready = harness.wait_state("a", "ready")
    assert ready.process is not None
    harness.send(Park(deployment="a", generation=1, release_bound_bytes=GiB, verify_s=3))
    stopped = harness.wait_state("a", "stopped", timeout=30)
    assert group_members(ready.process.pgid) == []
    assert harness.device_bytes(ready) == (0, 0)
    assert harness.secret_or_none("a") is None, "the per-launch key is dropped"

    held = format_size(BUDGET)  # everything it held while ready
    why = f"park: memory not released: {held} still held on gpu0 after 3s (parked charge 1.0 GiB)"
    steps = [(e["from_state"], e["to_state"], e["reason"]) for e in _transitions(harness)[-3:]]
    assert steps == [
        ("ready", "parking", "park: requested"),
        ("parking", "stopping", why),
        ("stopping", "stopped", f"stopped: {why}"),
    ]
    assert stopped.generation == 1


def test_a_park_memwatch_never_sees_stops_the_instance_as_unobserved(
    hostd: tuple[Hostd, str], model: Path
) -> None:
    harness, gpu = hostd  # no memwatch runs
    harness.send(launch("a", 1, gpu, model))
    ready = harness.wait_state("a", "ready")
    assert ready.process is not None
    harness.send(Park(deployment="a", generation=1, release_bound_bytes=GiB, verify_s=1))
    harness.wait_state("a", "stopped", timeout=30)
    assert group_members(ready.process.pgid) == []
    stopping = _transitions(harness)[-2]
    assert (stopping["from_state"], stopping["to_state"]) == ("parking", "stopping")
    assert stopping["reason"] == (
        f"park: memory release unobserved: no fresh memwatch reading of {gpu} within 1s "
        "(parked charge 1.0 GiB)"
    )
