"""What a start tells its engine it may take (issue 37): vLLM's --gpu-memory-utilization is a
share of the whole card (vLLM's `request_memory`: total_memory x the fraction, refused unless
that much is free), SGLang's --mem-fraction-static a share of the memory free when it starts
(SGLang's `profile_max_num_token`: the KV cache gets what is left of the fraction x the free
memory it read once its CUDA context existed, and "Not enough memory" when nothing is)."""

from __future__ import annotations

import pytest

from capycommon.domain.instances import InstanceState
from capycommon.engines.families import Family
from capyctl_scheduler.actions import Action
from capyctl_scheduler.charges import charged
from capyctl_scheduler.engineterms import CUDA_CONTEXT, told_fraction
from capyctl_scheduler.launchcommand import launch_command
from capyctl_scheduler.policy import plan
from capyctl_scheduler.sizing import engine_footprints
from capyctl_scheduler.snapshot import Binding, Snapshot
from unit.launches import resolved
from unit.test_first_starts import H200, HOST, view
from unit.test_policy import deployment, instance, load

S = InstanceState
GiB = 1 << 30


def beside_a_ready_model(family: Family) -> tuple[Snapshot, Action]:
    """On an H200, `a` (vLLM, 52 GiB of weights) ready, and `b` (`family`, 20 GiB) demanded:
    the snapshot and b's start, which fits beside a."""
    host = view(H200)
    bindings = {}
    for each in (resolved(Family.VLLM, 52 * GiB, name="a"), resolved(family, 20 * GiB, name="b")):
        bindings[each.deployment.name] = {HOST: Binding(HOST, each, engine_footprints(each, host))}
    records = [deployment("a"), deployment("b", engine=family.value)]
    found = Snapshot(
        now=100.0,
        deployments={r.name: r for r in records},
        instances={"a": instance("a", S.READY, since=10.0)},
        hosts={HOST: host},
        bindings=bindings,
        demands={"b": 99.0},
        loads={"a": load(1, 0, 99.0, active=10.0)},
    )
    (start,) = [action for action in plan(found) if action.kind == "start"]
    return found, start


def test_sglang_beside_a_ready_model_is_told_its_budget_of_the_memory_free_at_its_start() -> None:
    found, start = beside_a_ready_model(Family.SGLANG)
    footprint = found.bindings["b"][HOST].footprints["gpu0"]
    budget = footprint.engine_budget
    free = H200 - charged(found, HOST).total("gpu0")  # the card less a's ready charge
    told = launch_command(found, found.deployments["b"], start).memory_fraction
    assert told is not None
    # What SGLang holds for weights and KV cache: the fraction of what it finds free.
    static = told * (free - CUDA_CONTEXT)
    assert static >= budget, "told a share of the whole card, it would find too little free"
    assert static <= budget + (free - CUDA_CONTEXT) / 100, "rounded up to a hundredth"
    assert start.device_free == free
    assert footprint.charge("starting")["gpu0"] >= CUDA_CONTEXT + static, "charged what it takes"


def test_vllm_beside_a_ready_model_is_told_its_budget_of_the_whole_card() -> None:
    found, start = beside_a_ready_model(Family.VLLM)
    budget = found.bindings["b"][HOST].footprints["gpu0"].engine_budget
    told = launch_command(found, found.deployments["b"], start).memory_fraction
    assert told == told_fraction(budget, H200)
    assert told * H200 >= budget
    free = H200 - charged(found, HOST).total("gpu0")
    assert told * H200 <= free - CUDA_CONTEXT, "vLLM starts only when its share of the card is free"


@pytest.mark.parametrize("family", [Family.VLLM, Family.SGLANG])
def test_on_an_empty_card_both_are_told_about_the_same_share(family: Family) -> None:
    host = view(H200)
    found = resolved(family, 20 * GiB, name="b")
    snapshot = Snapshot(
        now=100.0,
        deployments={"b": deployment("b", engine=family.value)},
        instances={},
        hosts={HOST: host},
        bindings={"b": {HOST: Binding(HOST, found, engine_footprints(found, host))}},
        demands={"b": 99.0},
    )
    (start,) = plan(snapshot)
    assert start.device_free == H200
    told = launch_command(snapshot, snapshot.deployments["b"], start).memory_fraction
    budget = snapshot.bindings["b"][HOST].footprints["gpu0"].engine_budget
    assert told is not None
    # SGLang's share is of the card less its CUDA context: a hundredth more at most.
    assert 0 <= told - told_fraction(budget, H200) <= 0.011
