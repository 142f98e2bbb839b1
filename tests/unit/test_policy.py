"""The scheduler's choices, as a pure function of a snapshot and an injected clock."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from capycommon.deployments import parse_deployment
from capycommon.domain.desired import Attempts, DeploymentRecord, Inflight
from capycommon.domain.hosts import EngineLoad
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.domain.places import Places
from capycommon.engines.families import Family
from capycommon.errors import ProfileNotPublished
from capyctl_scheduler import placement
from capyctl_scheduler.actions import Action
from capyctl_scheduler.charges import charged
from capyctl_scheduler.engineterms import CUDA_CONTEXT
from capyctl_scheduler.ledger import GiB, derive_discrete, derive_domains, derive_unified
from capyctl_scheduler.policy import plan, quiet_until
from capyctl_scheduler.snapshot import Binding, HostView, Snapshot, Tunables
from unit.launches import terms
from unit.readings import idle_reading

S = InstanceState
HOST = "local"
# A model charged 14 GiB on its card: a 12.75 GiB request plus 1.25 GiB of CUDA context.
REQUEST = 12 * GiB + 3 * GiB // 4
# Parked, a vLLM 0.29 engine on a 24 GiB card keeps its CUDA context and its graph pool: its
# graphs of up to 512 sequences (twice its default of 256), 2 MiB each.
PARKED = CUDA_CONTEXT + 512 * (2 << 20)


def view(*sizes: int, unified: bool = False, ram: int = 256 * GiB) -> HostView:
    reading = idle_reading(*((size, unified) for size in sizes), ram=ram)
    domains = {domain.name: domain for domain in derive_domains(reading)}
    gpus = {f"gpu{i}": f"GPU-{i}" for i in range(len(sizes))}
    return HostView(HOST, domains, gpus, unified=unified)


def deployment(name: str, revision: int = 1, **fields: Any) -> DeploymentRecord:
    document: dict[str, Any] = {"name": name, "engine": "vllm", "model": name}
    record: dict[str, Any] = {}
    for key, value in fields.items():
        (record if key in DeploymentRecord.model_fields else document)[key] = value
    return DeploymentRecord(
        name=name,
        revision=revision,
        digest="sha256:x",
        created_at=0.0,
        updated_at=0.0,
        document=parse_deployment(document, "test"),
        generation=record.pop("generation", 1),
        **record,
    )


def instance(
    name: str,
    state: InstanceState,
    generation: int = 1,
    since: float = 0.0,
    gpu: int = 0,
    residency: str = "host_backed",
    revision: int = 1,
) -> InstanceRecord:
    return InstanceRecord(
        deployment=name,
        instance=0,
        revision=revision,
        generation=generation,
        state=state,
        since=since,
        host=HOST,
        gpu_uuid=f"GPU-{gpu}",
        residency=residency,
    )


def binding(host: HostView, weights: int = 10 * GiB, request: int | None = REQUEST) -> Binding:
    if host.unified:
        pool = host.domains["unified"]
        vllm = terms(Family.VLLM, pool.capacity)
        footprint = derive_unified(weights=weights, domain=pool, terms=vllm, request=request)
        return Binding(HOST, footprints=dict.fromkeys(host.gpus, footprint))
    startup = (request or 0) + 5 * GiB // 4
    return discrete(host, weights, request, host_backed=True, declared_startup=startup)


def derived(host: HostView, weights: int, request: int | None = None, **document: Any) -> Binding:
    """A binding whose startup peak was never measured nor declared: a vLLM deployment's,
    or of the engine and settings `document` names (`family`, `engine_config`)."""
    return discrete(host, weights, request, host_backed=False, **document)


def discrete(
    host: HostView,
    weights: int,
    request: int | None,
    host_backed: bool,
    declared_startup: int | None = None,
    **document: Any,
) -> Binding:
    """A footprint derived on each of `host`'s discrete GPUs, for the engine and settings
    `document` names (`family`, vLLM by default, and `engine_config`)."""
    family = document.pop("family", Family.VLLM)
    footprints = {
        gpu: derive_discrete(
            gpu=gpu,
            weights=weights,
            device=host.domains[gpu],
            host_backed=host_backed,
            terms=terms(family, host.domains[gpu].capacity, **document),
            request=request,
            startup=None if declared_startup is None else (declared_startup, "declared"),
        )
        for gpu in host.gpus
    }
    return Binding(HOST, footprints=footprints)


def snapshot(
    now: float,
    records: list[DeploymentRecord],
    instances: list[InstanceRecord] = (),  # type: ignore[assignment]
    host: HostView | None = None,
    sizing: HostView | None = None,
    **fields: Any,
) -> Snapshot:
    host = host or view(24 * GiB)
    sizing = sizing or host
    return Snapshot(
        now=now,
        deployments={r.name: r for r in records},
        instances={i.deployment: i for i in instances},
        hosts={HOST: host},
        bindings={r.name: {HOST: binding(sizing)} for r in records},
        **fields,
    )


def kinds(actions: list[Action]) -> list[tuple[str, str]]:
    return [(a.kind, a.deployment) for a in actions if a.kind != "wait"]


def waits(actions: list[Action]) -> list[str]:
    return [a.reason for a in actions if a.kind == "wait"]


def load(generation: int, running: int, at: float, active: float = 0.0) -> EngineLoad:
    return EngineLoad(
        generation=generation, running=running, waiting=0, last_active_at=active, read_at=at
    )


def effect(kind: str, sent_at: float, generation: int = 1, **fields: Any) -> Inflight:
    """An effect of `kind` on gpu0 of the host, for `generation`, sent at `sent_at`."""
    return Inflight(
        kind=kind, host=HOST, gpu="gpu0", generation=generation, sent_at=sent_at, **fields
    )


def drain_to_park(sent_at: float, reason: str) -> Inflight:
    """The drain of a ready a (generation 1, on gpu0) sent at `sent_at`, to park it after."""
    return effect(
        "drain", sent_at, from_state="ready", from_generation=1, then="park", reason=reason
    )


def b_demanded(
    now: float = 50.0,
    records: list[DeploymentRecord] | None = None,
    a: InstanceRecord | None = None,
    **fields: Any,
) -> Snapshot:
    """A switch in the making: a (ready unless said) holds the 24 GiB gpu0 and b, demanded
    at 49 s, needs its memory; both are charged 14 GiB."""
    records = records or [deployment("a"), deployment("b")]
    return snapshot(now, records, [a or instance("a", S.READY)], demands={"b": 49.0}, **fields)


# Starting and waking on demand --------------------------------------------------------------


def test_a_demand_starts_a_cold_deployment_with_the_next_generation() -> None:
    actions = plan(snapshot(100.0, [deployment("a", generation=4)], demands={"a": 99.0}))
    (start,) = actions
    assert (start.kind, start.gpu, start.generation) == ("start", "gpu0", 5)
    assert plan(snapshot(100.0, [deployment("a")])) == [], "no demand, nothing to do"


def test_a_demand_wakes_a_parked_instance_where_it_parked() -> None:
    host = view(24 * GiB, 24 * GiB)
    actions = plan(
        snapshot(
            100.0,
            [deployment("a")],
            [instance("a", S.PARKED, gpu=1)],
            host=host,
            demands={"a": 99.0},
        )
    )
    assert [(a.kind, a.gpu) for a in actions] == [("wake", "gpu1")]


def test_ready_satisfies_the_demand() -> None:
    actions = plan(snapshot(1.0, [deployment("a")], [instance("a", S.READY)], demands={"a": 0.0}))
    assert kinds(actions) == [("satisfied", "a")]


def test_placement_across_two_gpus_takes_the_most_headroom() -> None:
    host = view(24 * GiB, 24 * GiB)
    records = [deployment("a"), deployment("b")]
    actions = plan(
        snapshot(1.0, records, [instance("a", S.READY, gpu=0)], host=host, demands={"b": 0.0})
    )
    assert [(a.kind, a.deployment, a.gpu) for a in actions] == [("start", "b", "gpu1")]
    pinned = [deployment("a"), deployment("b", devices=[{"id": "gpu0"}])]
    actions = plan(
        snapshot(
            1.0,
            pinned,
            [instance("a", S.READY, gpu=0)],
            host=host,
            demands={"b": 0.0},
            loads={"a": load(1, 2, 1.0)},
        )
    )
    assert kinds(actions) == [], "pinned to the full gpu0, whose model is busy"
    assert "insufficient_resources: needs 14.0 GiB on gpu0, 8.1 GiB free" in waits(actions)[0]


def test_placement_breaks_a_tie_by_the_lowest_gpu_and_keeps_to_a_pinned_one() -> None:
    host = view(24 * GiB, 24 * GiB)
    free = snapshot(1.0, [deployment("b")], host=host)
    placed = placement.best(free, free.deployments["b"], {HOST: charged(free, HOST)})
    assert placed is not None
    assert (placed.host, placed.gpu) == (HOST, "gpu0"), "a tie goes to the lowest index"
    assert "not local gpu1: 22.1 GiB headroom" in placement.explain(
        free, free.deployments["b"], placed
    )
    records = [deployment("a"), deployment("b", devices=[{"id": "gpu0"}])]
    busy = snapshot(1.0, records, [instance("a", S.READY, gpu=0)], host=host)
    ledgers = {HOST: charged(busy, HOST)}
    pinned = placement.best(busy, busy.deployments["b"], ledgers)
    assert pinned is not None
    assert pinned.gpu == "gpu0", "pinned, though gpu1 has more room"
    elsewhere = deployment("b", devices=[{"id": "gpu7"}])
    unseen = replace(busy, deployments={**busy.deployments, "b": elsewhere})
    assert placement.best(unseen, elsewhere, ledgers) is None, "a GPU with no reading"


def test_starts_are_one_at_a_time_per_gpu() -> None:
    host = view(80 * GiB)
    records = [deployment("a"), deployment("b")]
    actions = plan(
        snapshot(1.0, records, [instance("a", S.STARTING)], host=host, demands={"b": 0.0})
    )
    assert kinds(actions) == []
    assert waits(actions) == ["starts are one at a time on gpu0: a is starting"]


def test_two_demands_in_one_plan_do_not_both_take_the_same_memory() -> None:
    host = view(24 * GiB, 24 * GiB)
    records = [deployment("a"), deployment("b"), deployment("c")]
    actions = plan(snapshot(1.0, records, host=host, demands={"a": 0.0, "b": 1.0, "c": 2.0}))
    assert [(a.kind, a.deployment, a.gpu) for a in actions if a.kind == "start"] == [
        ("start", "a", "gpu0"),
        ("start", "b", "gpu1"),
    ]
    assert waits(actions) == ["starts are one at a time on gpu0: a is starting"], "c waits"


def test_two_demands_in_one_plan_start_one_at_a_time_on_a_gpu_that_fits_both() -> None:
    host = view(80 * GiB)
    records = [deployment("a"), deployment("b")]
    snap = snapshot(1.0, records, host=host, demands={"a": 0.0, "b": 1.0})
    actions = plan(snap)
    assert [(a.kind, a.deployment, a.gpu) for a in actions if a.kind == "start"] == [
        ("start", "a", "gpu0")
    ]
    assert waits(actions) == ["starts are one at a time on gpu0: a is starting"]
    assert plan(snap) == actions, "the plan is a pure function of its snapshot"


def test_a_launch_in_flight_is_charged_and_not_repeated() -> None:
    launch = effect("launch", 0.5, generation=2)
    records = [deployment("a", generation=2, inflight=launch), deployment("b")]
    snap = snapshot(1.0, records, demands={"a": 0.0, "b": 0.0})
    assert "a" in charged(snap, HOST).charges, "charged from the moment it is sent"
    actions = plan(snap)
    assert kinds(actions) == [], "nothing more for a; b waits for the start on gpu0"


def test_an_unobserved_host_admits_nothing() -> None:
    host = view(24 * GiB)
    stale = HostView(HOST, {}, host.gpus, unified=False)
    actions = plan(snapshot(1.0, [deployment("a")], host=stale, sizing=host, demands={"a": 0.0}))
    assert kinds(actions) == []
    assert "device_unobserved" in waits(actions)[0]


# Switching ------------------------------------------------------------------------------------


def test_three_14gib_models_on_a_24gib_gpu_switch_in_turn() -> None:
    records = [deployment("a"), deployment("b"), deployment("c")]
    # a serves, b is demanded: a (idle) drains to park, and b waits for its memory.
    ready = instance("a", S.READY, since=10.0)
    actions = plan(b_demanded(50.0, records, ready, loads={"a": load(1, 0, 49.0, active=20.0)}))
    drain = next(a for a in actions if a.kind == "drain")
    assert (drain.deployment, drain.then) == ("a", "park")
    assert "switch to b" in drain.reason
    assert waits(actions) == ["switch: releasing a to start b on gpu0"]
    # a drains (the draining record and the effect in flight): b keeps waiting.
    flying = drain_to_park(50.0, drain.reason)
    drained = [records[0].model_copy(update={"inflight": flying}), *records[1:]]
    draining = instance("a", S.DRAINING, since=50.0)
    actions = plan(b_demanded(51.0, drained, draining, loads={"a": load(1, 0, 50.5)}))
    park = next(a for a in actions if a.kind == "park")
    assert park.release_bound == PARKED, "the parked charge bounds what it may keep"
    assert waits(actions) == ["switch: waiting for memory being released to start"]
    # a parked: b starts beside a's residue.
    actions = plan(b_demanded(60.0, records, instance("a", S.PARKED, since=55.0)))
    assert kinds(actions) == [("start", "b")]
    # c comes: b (ready, least recently used is a but a is parked already) is the victim.
    state = [instance("a", S.PARKED, since=55.0), instance("b", S.READY, since=70.0)]
    actions = plan(snapshot(80.0, records, state, demands={"c": 79.0}))
    assert [(a.kind, a.deployment, a.then) for a in actions if a.kind != "wait"] == [
        ("drain", "b", "park")
    ]


def test_a_busy_victim_is_never_chosen_and_the_switch_waits() -> None:
    actions = plan(b_demanded(loads={"a": load(1, 3, 49.5)}))
    assert kinds(actions) == []
    assert "1 busy, warm or explicit kept" in waits(actions)[0]
    # Once it reads idle, it is chosen.
    actions = plan(b_demanded(55.0, loads={"a": load(1, 0, 54.5, active=53.0)}))
    assert kinds(actions) == [("drain", "a")]


def test_warm_and_explicit_deployments_are_never_victims() -> None:
    for protected in (
        deployment("a", lifecycle={"warm": True}),
        deployment("a", lifecycle={"activation": "explicit"}, wanted="ready"),
    ):
        actions = plan(b_demanded(records=[protected, deployment("b")]))
        assert kinds(actions) == [("refuse", "b")], "it can never fit beside a: refused at once"
        assert actions[0].error == "insufficient_resources"
        assert (
            "needs 14.0 GiB on gpu0, which holds at most 22.1 GiB for models" in actions[0].reason
        )
        assert "frees 0 B, leaving 8.1 GiB (a: warm, explicit or unknown" in actions[0].reason


def test_a_busy_holder_is_waited_for_not_refused() -> None:
    actions = plan(b_demanded(loads={"a": load(1, 3, 49.5)}))
    assert kinds(actions) == []
    assert waits(actions)[0].startswith("insufficient_resources: ")


def test_a_model_bigger_than_the_card_is_refused_at_once() -> None:
    record = deployment("big")
    found = snapshot(1.0, [record], demands={"big": 0.5})
    big = derived(found.hosts[HOST], weights=10 * GiB, request=30 * GiB)
    actions = plan(replace(found, bindings={"big": {HOST: big}}))
    assert kinds(actions) == [("refuse", "big")]
    assert (
        "needs 31.2 GiB on gpu0, which holds at most 22.1 GiB for models (24.0 GiB with 1.9 GiB "
        "reserve); stopping every model that may be evicted frees 0 B"
    ) in actions[0].reason


def test_a_document_no_host_can_run_is_refused_at_once() -> None:
    found = snapshot(1.0, [deployment("a")], demands={"a": 0.5})
    broken = Binding(HOST, error=ProfileNotPublished("no engine named 'vllm' on host local"))
    (refuse,) = plan(replace(found, bindings={"a": {HOST: broken}}))
    assert (refuse.kind, refuse.error) == ("refuse", "profile_not_published")
    assert refuse.reason == "profile_not_published: no engine named 'vllm' on host local"


def test_a_first_start_stops_the_victim_that_parking_would_not_shrink_enough() -> None:
    # 6 GiB models on a 24 GiB card, on SGLang with 8192-token chunked prefills: by SGLang's
    # terms a start needs 10.6 GiB of weights and KV cache, 12 GiB of activations beside them
    # and more: only an empty card holds that, not one with a parked residue. The ready one
    # stops instead of parking.
    found = b_demanded()
    chunked = {"extra_args": ["--chunked-prefill-size", "8192"]}
    six = derived(found.hosts[HOST], weights=6 * GiB, family=Family.SGLANG, engine_config=chunked)
    assert six.footprints["gpu0"].device_provenance == "whole_device"
    found = replace(found, bindings={name: {HOST: six} for name in ("a", "b")})
    actions = plan(found)
    assert [(a.kind, a.deployment, a.then) for a in actions if a.kind != "wait"] == [
        ("drain", "a", "stop")
    ]
    assert "parking it would not free enough" in actions[0].reason


def test_the_least_recently_used_goes_first() -> None:
    host = view(24 * GiB, 24 * GiB)
    records = [deployment("a"), deployment("b"), deployment("c", devices=[{"id": "gpu1"}])]
    state = [instance("a", S.READY, gpu=0, since=10.0), instance("b", S.READY, gpu=1, since=5.0)]
    loads = {"a": load(1, 0, 99.0, active=90.0), "b": load(1, 0, 99.0, active=40.0)}
    actions = plan(snapshot(100.0, records, state, host=host, demands={"c": 99.0}, loads=loads))
    assert kinds(actions) == [("drain", "b")], "b, idle since 40 s, on c's pinned GPU"


def test_a_victim_that_cannot_park_stops() -> None:
    actions = plan(b_demanded(a=instance("a", S.READY, residency="restart_only")))
    drain = next(a for a in actions if a.kind == "drain")
    assert drain.then == "stop"
    assert "cannot park" in drain.reason


def test_a_parked_victim_stops() -> None:
    records = [deployment("a"), deployment("b"), deployment("c")]
    # a and b parked hold 1 GiB each; c's start fits beside them without any victim.
    state = [instance("a", S.PARKED), instance("b", S.PARKED)]
    assert kinds(plan(snapshot(5.0, records, state, demands={"c": 1.0}))) == [("start", "c")]
    # With a 20 GiB request c needs the whole card: the parked ones stop, oldest first.
    big = [deployment("a"), deployment("b"), deployment("c")]
    snap = snapshot(5.0, big, state, demands={"c": 1.0})
    c_binding = binding(snap.hosts[HOST], request=20 * GiB)
    snap = Snapshot(**{**snap.__dict__, "bindings": {**snap.bindings, "c": {HOST: c_binding}}})
    assert kinds(plan(snap)) == [("stop", "a"), ("stop", "b")]


def test_a_drain_that_outlasts_its_timeout_serves_again() -> None:
    records = [deployment("a", inflight=drain_to_park(10.0, "idle"))]
    draining = [instance("a", S.DRAINING, since=10.0)]
    busy = {"a": load(1, 2, 30.0)}
    assert kinds(plan(snapshot(30.0, records, draining, loads=busy))) == []
    actions = plan(snapshot(41.0, records, draining, loads={"a": load(1, 2, 41.0)}))
    assert kinds(actions) == [("undrain", "a")]
    assert "drain timed out after 31s with 2 requests" in actions[0].reason


def test_a_drain_with_cut_requests_parks_only_on_a_load_read_after_it_began() -> None:
    records = [deployment("a", inflight=drain_to_park(10.0, "idle"))]
    draining = [instance("a", S.DRAINING, since=10.0)]
    # A request cut before any answer may still be in the engine's queue.
    cut = {"a": Places(generation=1, running=1, settle_at_stop=1)}
    before = snapshot(11.0, records, draining, loads={"a": load(1, 0, 9.5)}, places=cut)
    assert kinds(plan(before)) == []
    after = snapshot(11.0, records, draining, loads={"a": load(1, 0, 10.5)}, places=cut)
    assert kinds(plan(after)) == [("stop", "a")], "such a request settles only at a stop"


def test_a_drain_that_no_router_request_holds_parks_at_once() -> None:
    records = [deployment("a", inflight=drain_to_park(10.0, "idle"))]
    draining = [instance("a", S.DRAINING, since=10.0)]
    # No place of its generation is held, and none can be taken once it drains: its last
    # reading, idle, needs no successor.
    quiet = snapshot(10.01, records, draining, loads={"a": load(1, 0, 9.5)})
    assert kinds(plan(quiet)) == [("park", "a")]
    given_back = {"a": Places(generation=1)}
    assert kinds(plan(replace(quiet, places=given_back))) == [("park", "a")]
    # An engine that read busy is waited for (a request of a router that was killed).
    busy = snapshot(10.01, records, draining, loads={"a": load(1, 1, 9.5)})
    assert kinds(plan(busy)) == []
    # A place still held keeps it, as before.
    held = {"a": Places(generation=1, running=1)}
    assert kinds(plan(replace(quiet, places=held))) == []


def test_a_drain_waits_for_the_routers_spare_places() -> None:
    records = [deployment("a", inflight=drain_to_park(10.0, "idle"))]
    draining = [instance("a", S.DRAINING, since=10.0)]
    quiet = snapshot(10.01, records, draining, loads={"a": load(1, 0, 9.5)})
    # A spare may carry a request its router let through before it heard of the drain.
    spare = {"a": Places(generation=1, spare=1)}
    assert kinds(plan(replace(quiet, places=spare))) == []
    read_after = replace(quiet, loads={"a": load(1, 0, 10.005)}, places=spare)
    assert kinds(plan(read_after)) == [], "an idle reading does not prove it unused"
    stale = {"a": Places(generation=0, spare=1)}
    assert kinds(plan(replace(quiet, places=stale))) == [("park", "a")], "another generation's"


# Idle timeouts --------------------------------------------------------------------------------


def test_idle_park_then_idle_stop_with_an_injected_clock() -> None:
    record = deployment("a", lifecycle={"ready_idle_timeout": "5m", "parked_idle_timeout": "30m"})
    ready = [instance("a", S.READY, since=0.0)]
    active = {"a": load(1, 0, 400.0, active=100.0)}
    assert kinds(plan(snapshot(399.0, [record], ready, loads=active))) == []
    actions = plan(snapshot(400.0, [record], ready, loads=active))
    assert [(a.kind, a.then, a.reason) for a in actions] == [("drain", "park", "idle for 5m")]
    parked = [instance("a", S.PARKED, since=500.0)]
    assert kinds(plan(snapshot(2299.0, [record], parked))) == []
    assert [(a.kind, a.reason) for a in plan(snapshot(2300.0, [record], parked))] == [
        ("stop", "parked idle for 30m")
    ]


def test_the_roles_idle_defaults_apply_unless_the_deployment_says_never() -> None:
    ready = [instance("a", S.READY, since=0.0)]
    assert plan(snapshot(299.0, [deployment("a")], ready)) == []
    (drain,) = plan(snapshot(300.0, [deployment("a")], ready))
    assert (drain.kind, drain.reason) == ("drain", "idle for 5m"), "the role's default, 5m"
    parked = [instance("a", S.PARKED, since=0.0)]
    (stop,) = plan(snapshot(1800.0, [deployment("a")], parked))
    assert (stop.kind, stop.reason) == ("stop", "parked idle for 30m")
    never = deployment(
        "a", lifecycle={"ready_idle_timeout": "never", "parked_idle_timeout": "never"}
    )
    assert plan(snapshot(1e6, [never], ready)) == []
    assert plan(snapshot(1e6, [never], parked)) == []
    off = Tunables(ready_idle_s=None, parked_idle_s=None)
    assert plan(snapshot(1e6, [deployment("a")], ready, tunables=off)) == []
    own = deployment("a", lifecycle={"ready_idle_timeout": "1m"})
    assert kinds(plan(snapshot(60.0, [own], ready, tunables=off))) == [("drain", "a")]
    warm = deployment("a", lifecycle={"ready_idle_timeout": "1m", "warm": True})
    assert plan(snapshot(1e6, [warm], ready)) == []


def test_a_quiet_plan_is_next_looked_at_when_an_idle_step_comes_due() -> None:
    record = deployment("a", lifecycle={"ready_idle_timeout": "5m", "parked_idle_timeout": "30m"})
    assert quiet_until(snapshot(1.0, [record]), []) == math.inf, "nothing runs: nothing due"
    ready = [instance("a", S.READY, since=0.0)]
    active = {"a": load(1, 0, 200.0, active=100.0)}
    quiet = snapshot(200.0, [record], ready, loads=active)
    assert plan(quiet) == []
    assert quiet_until(quiet, []) == 400.0, "the ready idle step: last used + 5m"
    parked = snapshot(600.0, [record], [instance("a", S.PARKED, since=500.0)])
    assert quiet_until(parked, []) == 2300.0, "the parked idle step: parked + 30m"
    never = deployment(
        "a", lifecycle={"ready_idle_timeout": "never", "parked_idle_timeout": "never"}
    )
    assert quiet_until(snapshot(1e6, [never], ready), []) == math.inf


def test_a_plan_with_anything_under_way_is_looked_at_each_second() -> None:
    record = deployment("a", lifecycle={"ready_idle_timeout": "5m"})
    ready = [instance("a", S.READY, since=0.0)]
    busy = {"a": load(1, 1, 400.0, active=0.0)}
    due = snapshot(400.0, [record], ready, loads=busy)
    assert plan(due) == [], "due, but it serves: nothing yet"
    assert quiet_until(due, []) is None, "the step waits for the requests to end"
    assert quiet_until(snapshot(1.0, [record], demands={"a": 0.5}), []) is None
    acted = plan(snapshot(1.0, [record], demands={"a": 0.5}))
    assert quiet_until(snapshot(1.0, [record]), acted) is None, "an action was asked for"
    for state in (S.STARTING, S.WAKING, S.PARKING, S.DRAINING, S.STOPPING, S.RECONCILING):
        moving = snapshot(1.0, [record], [instance("a", state)])
        assert quiet_until(moving, []) is None, state
    flying = deployment("a", inflight=drain_to_park(0.5, "idle"))
    assert quiet_until(snapshot(1.0, [flying], ready), []) is None
    revised = snapshot(1.0, [deployment("a", revision=2)], ready, loads=busy)
    assert plan(revised) == [], "a new revision waits for the requests to end"
    assert quiet_until(revised, []) is None
    orphan = instance("gone", S.READY)
    assert quiet_until(snapshot(1.0, [record], orphans=(orphan,)), []) is None


def test_a_restart_only_model_stops_when_idle() -> None:
    record = deployment("a", lifecycle={"ready_idle_timeout": "1m"})
    ready = [instance("a", S.READY, residency="restart_only")]
    (drain,) = plan(snapshot(61.0, [record], ready))
    assert (drain.kind, drain.then) == ("drain", "stop")


# Failures, operator stop, deletion ------------------------------------------------------------


def test_failed_starts_are_counted_once_then_retried_after_the_cooldown() -> None:
    failed = [instance("a", S.FAILED, generation=3).model_copy(update={"error": "launch failed"})]
    record = deployment("a", generation=3)
    (count,) = plan(snapshot(10.0, [record], failed, demands={"a": 1.0}))
    assert (count.kind, count.error) == ("count_failure", "launch failed")
    counted = record.model_copy(
        update={
            "attempts": Attempts(
                count=1, next_at=40.0, last_error="launch failed", counted_generation=3
            )
        }
    )
    actions = plan(snapshot(20.0, [counted], failed, demands={"a": 1.0}))
    assert waits(actions) == ["retry in 20s after: launch failed"]
    actions = plan(snapshot(40.0, [counted], failed, demands={"a": 1.0}))
    assert [(a.kind, a.generation) for a in actions] == [("start", 4)]
    spent = record.model_copy(
        update={"attempts": Attempts(count=4, failed=True, counted_generation=3)}
    )
    assert kinds(plan(snapshot(500.0, [spent], failed, demands={"a": 1.0}))) == [
        ("drop_demand", "a")
    ]


def test_an_operator_stop_stops_and_refuses_demands() -> None:
    record = deployment("a", stopped=True)
    actions = plan(snapshot(1.0, [record], [instance("a", S.READY)], demands={"a": 0.5}))
    assert [(a.kind, a.reason) for a in actions] == [
        ("drop_demand", "deployment_stopped"),
        ("stop", "operator stop"),
    ]


def test_explicit_activation_follows_the_operator_only() -> None:
    explicit = {"activation": "explicit", "ready_idle_timeout": "1m"}
    idle = deployment("a", lifecycle=explicit)
    assert plan(snapshot(1.0, [idle], demands={"a": 0.5})) == [], "a demand does not start it"
    wanted = deployment("a", lifecycle=explicit, wanted="ready")
    assert kinds(plan(snapshot(1.0, [wanted]))) == [("start", "a")]
    ready = [instance("a", S.READY)]
    assert plan(snapshot(1e6, [wanted], ready)) == [], "no idle park"
    parked = deployment("a", lifecycle=explicit, wanted="parked")
    assert kinds(plan(snapshot(1.0, [parked], ready))) == [("drain", "a")]


def test_deletion_stops_then_forgets() -> None:
    record = deployment("a", deleting=True)
    assert kinds(plan(snapshot(1.0, [record], [instance("a", S.PARKED)]))) == [("stop", "a")]
    assert kinds(plan(snapshot(1.0, [record], [instance("a", S.STOPPED)]))) == [("forget", "a")]


def test_an_orphan_engine_is_stopped() -> None:
    orphan = instance("gone", S.READY)
    actions = plan(snapshot(1.0, [], orphans=(orphan,)))
    assert [(a.kind, a.deployment, a.reason) for a in actions] == [
        ("stop", "gone", "orphan: no deployment owns this engine")
    ]


def test_a_new_revision_replaces_an_idle_instance() -> None:
    record = deployment("a", revision=2)
    actions = plan(snapshot(1.0, [record], [instance("a", S.READY, revision=1)]))
    assert [(a.kind, a.then, a.reason) for a in actions] == [
        ("drain", "stop", "revision 2 replaces revision 1")
    ]


# Effects in flight ----------------------------------------------------------------------------


def test_an_effect_settles_when_the_record_moves_on_or_hostd_refuses() -> None:
    park = effect("park", 1.0, from_state="draining", from_generation=1)
    record = deployment("a", inflight=park)
    pending = snapshot(2.0, [record], [instance("a", S.DRAINING)])
    assert plan(pending) == []
    moved = snapshot(2.0, [record], [instance("a", S.PARKING)])
    assert kinds(plan(moved)) == [("settle", "a")]
    refused = snapshot(2.0, [record], [instance("a", S.DRAINING)], refused=frozenset({("a", 1)}))
    assert kinds(plan(refused))[0] == ("settle", "a")
    expired = snapshot(200.0, [record], [instance("a", S.DRAINING)], tunables=Tunables())
    assert kinds(plan(expired))[0] == ("settle", "a")


def test_the_parked_set_is_bounded() -> None:
    records = [deployment(name) for name in "abc"]
    parked = [
        instance(name, S.PARKED, since=since)
        for name, since in zip("abc", (3.0, 1.0, 2.0), strict=True)
    ]
    actions = plan(
        snapshot(10.0, records, parked, host=view(80 * GiB), tunables=Tunables(max_parked=1))
    )
    assert [(a.kind, a.deployment) for a in actions] == [("stop", "b"), ("stop", "c")]


def test_unified_memory_charges_one_pool() -> None:
    host = view(128 * GiB, unified=True, ram=128 * GiB)
    snap = snapshot(1.0, [deployment("a")], [instance("a", S.READY)], host=host)
    assert set(charged(snap, HOST).charges["a"]) == {"unified"}
    actions = plan(snapshot(1.0, [deployment("a")], host=host, demands={"a": 0.0}))
    assert [(a.kind, a.gpu) for a in actions] == [("start", "gpu0")]


# Requests the routers hold ------------------------------------------------------------------


def test_router_places_make_a_model_busy_and_cut_requests_make_it_stop_not_park() -> None:
    serving = {"a": Places(generation=1, running=2)}
    actions = plan(b_demanded(places=serving))
    assert kinds(actions) == [], "a router has requests on it"
    cut = {"a": Places(generation=1, running=1, settle_at_stop=1)}
    actions = plan(b_demanded(places=cut))
    drain = next(a for a in actions if a.kind == "drain")
    assert drain.then == "stop", "a request cut before any answer may still be on the engine"
    stale = {"a": Places(generation=0, running=5, settle_at_stop=5)}
    actions = plan(b_demanded(places=stale))
    assert next(a for a in actions if a.kind == "drain").then == "park", "another generation's"
    spare = {"a": Places(generation=1, spare=1)}
    actions = plan(b_demanded(places=spare))
    assert next(a for a in actions if a.kind == "drain").then == "park", "a spare is no request"


def test_a_restart_is_asked_when_cut_requests_hold_every_place() -> None:
    def ready_at(generation: int) -> list[Action]:
        """The plan for a demanded a, ready at `generation`, when generation 3 is asked to
        restart."""
        ready = [instance("a", S.READY, generation=generation)]
        return plan(snapshot(5.0, [deployment("a")], ready, demands={"a": 4.0}, restarts={"a": 3}))

    assert [(a.kind, a.reason) for a in ready_at(3)] == [
        ("stop", "cancelled requests hold every place: restarting it")
    ]
    assert kinds(ready_at(4)) == [("satisfied", "a")], "the restart happened"


def test_a_park_without_parked_room_stops() -> None:
    host = view(24 * GiB, ram=16 * GiB)  # parked limit: 4 GiB of host RAM
    record = deployment("a", lifecycle={"ready_idle_timeout": "1m"})
    (drain,) = plan(snapshot(100.0, [record], [instance("a", S.READY)], host=host))
    assert drain.then == "stop", "a host_backed copy (4 + 15 GiB) has no room in 4 GiB"
