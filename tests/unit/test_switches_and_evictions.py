"""What the router's switch and eviction metrics and GPU gauges rest on, as plans: a switch
is recorded with its victims before they are released and ends once its model is ready;
each park or stop that takes an engine out carries its cause to the settle that counts it,
once; the engines' part of a switch from the hosts' events; and the ledger by GPU and phase.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from capycommon.domain.desired import DeploymentRecord, Inflight, Switch, Victim
from capycommon.domain.instances import Event, InstanceRecord
from capyctl_scheduler.actions import Action
from capyctl_scheduler.actuator import switch_engine_s
from capyctl_scheduler.charges import charged, gpu_memory
from capyctl_scheduler.ledger import GiB
from capyctl_scheduler.policy import plan
from capyctl_scheduler.snapshot import Snapshot, Tunables
from unit.test_policy import (
    HOST,
    PARKED,
    REQUEST,
    S,
    b_demanded,
    deployment,
    drain_to_park,
    instance,
    load,
    snapshot,
    view,
)

SWITCH = Switch(
    host=HOST, gpu="gpu0", started_at=50.0, victims=(Victim(deployment="a", generation=1),)
)


def evictions(actions: list[Action]) -> list[tuple[str, str, str | None]]:
    """Each action that takes an engine out or settles one, with its cause."""
    return [
        (a.kind, a.deployment, a.cause)
        for a in actions
        if a.kind in ("drain", "park", "stop", "settle")
    ]


def park_in_flight(cause: str | None) -> Inflight:
    return Inflight.model_validate(
        {
            "kind": "park",
            "host": HOST,
            "gpu": "gpu0",
            "generation": 1,
            "sent_at": 52.0,
            "from_state": "draining",
            "from_generation": 1,
            "reason": "switch to b",
            "cause": cause,
        }
    )


def test_a_switch_names_its_victims_and_carries_its_cause_to_the_settled_park() -> None:
    idle_a = {"a": load(1, 0, 49.0, active=20.0)}
    actions = plan(b_demanded(50.0, loads=idle_a))
    (wait,) = [a for a in actions if a.deployment == "b"]
    assert (wait.kind, wait.host, wait.gpu) == ("wait", HOST, "gpu0")
    assert wait.victims == (Victim(deployment="a", generation=1),)
    assert evictions(actions) == [("drain", "a", "switch")]

    # The drain's effect keeps the cause, and hands it to the park that ends it.
    drained = drain_to_park(50.0, "switch to b").model_copy(update={"cause": "switch"})
    records = [deployment("a", inflight=drained), deployment("b")]
    draining = instance("a", S.DRAINING, since=50.0)
    actions = plan(b_demanded(51.0, records, draining, loads={"a": load(1, 0, 50.5)}))
    assert evictions(actions) == [("park", "a", "switch")]
    assert not [a for a in actions if a.victims], "memory being released: no new victim"

    # The park is taken up (a parks): settled, as one eviction; not while it is pending.
    parked = [deployment("a", inflight=park_in_flight("switch")), deployment("b")]
    actions = plan(b_demanded(53.0, parked, instance("a", S.PARKING, since=52.5)))
    assert ("settle", "a", "switch") in evictions(actions)
    actions = plan(b_demanded(52.5, parked, instance("a", S.DRAINING, since=50.0)))
    assert not [a for a in actions if a.kind == "settle"]


def test_a_refused_park_and_an_undrained_drain_evict_nothing() -> None:
    parked = [deployment("a", inflight=park_in_flight("switch")), deployment("b")]
    refused = b_demanded(53.0, parked, instance("a", S.DRAINING), refused=frozenset({("a", 1)}))
    assert [(a.kind, a.cause) for a in plan(refused) if a.kind == "settle"] == [("settle", None)]

    drained = drain_to_park(50.0, "idle for 5m").model_copy(update={"cause": "idle"})
    wanted = snapshot(
        51.0,
        [deployment("a", inflight=drained)],
        [instance("a", S.DRAINING, since=50.0)],
        demands={"a": 50.5},
    )
    assert [(a.kind, a.cause) for a in plan(wanted)] == [("undrain", None)]


def cause_of(found: Snapshot) -> list[tuple[str, str | None]]:
    return [(a.kind, a.cause) for a in plan(found) if a.kind in ("drain", "stop")]


def test_each_way_an_engine_is_taken_out_names_its_cause() -> None:
    ready = instance("a", S.READY, since=10.0)
    quiet = {"a": load(1, 0, 9.0, active=5.0)}
    assert cause_of(snapshot(1000.0, [deployment("a")], [ready], loads=quiet)) == [
        ("drain", "idle")
    ]
    parked = instance("a", S.PARKED, since=10.0)
    assert cause_of(snapshot(4000.0, [deployment("a")], [parked])) == [("stop", "idle")]
    assert cause_of(snapshot(20.0, [deployment("a", stopped=True)], [ready])) == [
        ("stop", "operator")
    ]
    assert cause_of(snapshot(20.0, [deployment("a", deleting=True)], [ready])) == [
        ("stop", "operator")
    ]
    assert cause_of(snapshot(20.0, [deployment("a", park_requested=1)], [ready])) == [
        ("drain", "operator")
    ]
    assert cause_of(snapshot(20.0, [deployment("a", stop_requested=1)], [ready])) == [
        ("stop", "drain")
    ]
    assert cause_of(snapshot(20.0, [deployment("a")], [ready], restarts={"a": 1})) == [
        ("stop", "restart")
    ]
    assert cause_of(snapshot(20.0, [deployment("a", revision=2)], [ready], loads=quiet)) == [
        ("drain", "revision")
    ]
    many = [instance(n, S.PARKED, since=float(i)) for i, n in enumerate("ab")]
    bounded = snapshot(
        20.0, [deployment("a"), deployment("b")], many, tunables=Tunables(max_parked=1)
    )
    assert cause_of(bounded) == [("stop", "max_parked")]
    orphan = instance("gone", S.READY)
    assert cause_of(snapshot(20.0, [], orphans=(orphan,))) == [("stop", None)]


def with_switch(*records: DeploymentRecord) -> list[DeploymentRecord]:
    return [r.model_copy(update={"switch": SWITCH}) if r.name == "b" else r for r in records]


@pytest.mark.parametrize(
    ("b", "demanded", "inflight", "ends"),
    [
        (instance("b", S.READY, since=60.0, generation=2), False, False, "switched"),
        (instance("b", S.STARTING, since=55.0, generation=2), False, False, None),
        (None, True, False, None),
        (None, False, True, None),
        (None, False, False, "drop_switch"),
        (instance("b", S.PARKED, since=5.0), False, False, "drop_switch"),
    ],
)
def test_a_switch_ends_when_its_model_is_ready_or_no_longer_wanted(
    b: InstanceRecord | None, demanded: bool, inflight: bool, ends: str | None
) -> None:
    launch = Inflight(kind="launch", host=HOST, gpu="gpu0", generation=2, sent_at=54.0)
    target = deployment("b", generation=2, inflight=launch if inflight else None)
    records = with_switch(deployment("a"), target)
    instances = [instance("a", S.PARKED, since=55.0), *([b] if b else [])]
    found = snapshot(61.0, records, instances, demands={"b": 49.0} if demanded else {})
    ended = [a for a in plan(found) if a.kind in ("switched", "drop_switch")]
    assert [a.kind for a in ended] == ([ends] if ends else [])
    if ends == "switched":
        assert (ended[0].deployment, ended[0].generation) == ("b", 2)


def event(
    name: str, generation: int, states: tuple[str, str], at: float, **figures: float
) -> Event:
    return Event(
        kind="transition",
        host=HOST,
        deployment=name,
        instance=0,
        generation=generation,
        from_state=states[0],
        to_state=states[1],
        reason="test",
        at=at,
        **figures,
    )


def test_the_engines_part_of_a_switch_is_the_victims_releases_and_the_models_load() -> None:
    switch = SWITCH.model_copy(
        update={"victims": (*SWITCH.victims, Victim(deployment="c", generation=3))}
    )
    events = [
        event("a", 1, ("parking", "parked"), 40.0, duration_s=9.0, engine_s=9.0),  # before it
        event("a", 1, ("draining", "parking"), 52.0, duration_s=1.0),
        event("a", 1, ("parking", "parked"), 53.0, duration_s=1.0, engine_s=0.25),
        event("a", 2, ("parking", "parked"), 53.5, duration_s=1.0, engine_s=7.0),  # another
        event("c", 3, ("stopping", "stopped"), 54.0, duration_s=0.5),
        event("b", 2, ("starting", "ready"), 58.0, duration_s=3.0, engine_s=1.25),
        event("b", 1, ("waking", "ready"), 58.0, duration_s=3.0, engine_s=6.0),  # another
    ]
    assert switch_engine_s(switch, 2, "b", events) == 0.25 + 0.5 + 1.25


def test_gpu_memory_is_the_ledger_by_gpu_and_phase() -> None:
    host = view(24 * GiB, 24 * GiB)
    launch = Inflight(kind="launch", host=HOST, gpu="gpu1", generation=1, sent_at=0.5)
    records = [deployment("a"), deployment("b"), deployment("c", inflight=launch)]
    instances = [instance("a", S.READY), instance("b", S.PARKED)]
    found = snapshot(1.0, records, instances, host=host)
    summary = {gpu.gpu: gpu for gpu in gpu_memory(found).gpus}
    assert sorted(summary) == ["gpu0", "gpu1"], "host RAM is no GPU"
    ready = REQUEST + 5 * GiB // 4
    assert summary["gpu0"].charged == {"ready": ready, "parked": PARKED}
    assert summary["gpu1"].charged == {"starting": ready}
    ledger = charged(found, HOST)
    for name, gpu in summary.items():
        assert sum(gpu.charged.values()) == ledger.total(name)
        assert gpu.free == ledger.headroom(name)
        assert (gpu.capacity, gpu.reserve) == (24 * GiB, host.domains[name].free_reserve)
    unobserved = replace(found, hosts={HOST: replace(host, domains={})})
    assert gpu_memory(unobserved).gpus == ()
