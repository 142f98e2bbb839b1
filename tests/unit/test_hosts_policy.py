"""Planning across joined hosts: placement by headroom and placement.hosts, drained hosts, and
hosts whose heartbeat lapsed (unreachable, then gone) or that were revoked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from capycommon.domain.desired import Inflight
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.engines.families import Family
from capycommon.errors import NotFound
from capyctl_scheduler.charges import gpu_memory
from capyctl_scheduler.ledger import GiB, derive_discrete, derive_domains
from capyctl_scheduler.policy import HOST_CHECK_S, plan, quiet_until
from capyctl_scheduler.snapshot import Binding, HostView, Snapshot
from unit.launches import terms
from unit.readings import idle_reading
from unit.test_policy import REQUEST, deployment

S = InstanceState
NOW = 1000.0


def host(name: str, size: int = 24 * GiB, **facts: Any) -> HostView:
    reading = idle_reading((size, False))
    domains = {domain.name: domain for domain in derive_domains(reading)}
    return HostView(name, domains, {"gpu0": f"GPU-{name}"}, unified=False, joined=True, **facts)


def bound(view: HostView) -> Binding:
    footprint = derive_discrete(
        gpu="gpu0",
        weights=10 * GiB,
        device=view.domains["gpu0"],
        host_backed=True,
        terms=terms(Family.VLLM, view.domains["gpu0"].capacity),
        request=REQUEST,
        startup=(REQUEST + 5 * GiB // 4, "declared"),
    )
    return Binding(view.name, footprints={"gpu0": footprint})


def on(view: HostView, name: str, state: InstanceState, generation: int = 1) -> InstanceRecord:
    return InstanceRecord(
        deployment=name,
        instance=0,
        revision=1,
        generation=generation,
        state=state,
        since=0.0,
        host=view.name,
        gpu_uuid=f"GPU-{view.name}",
        residency="host_backed",
    )


def two_hosts(
    a: HostView, b: HostView, instances: Sequence[InstanceRecord] = (), **fields: Any
) -> Snapshot:
    records = fields.pop("records", [deployment("m")])
    return Snapshot(
        now=NOW,
        deployments={r.name: r for r in records},
        instances={i.deployment: i for i in instances},
        hosts={a.name: a, b.name: b},
        bindings={r.name: {a.name: bound(a), b.name: bound(b)} for r in records},
        **fields,
    )


def test_a_start_goes_to_the_host_with_the_most_headroom() -> None:
    actions = plan(two_hosts(host("a"), host("b", 48 * GiB), demands={"m": NOW}))
    assert [(x.kind, x.host) for x in actions] == [("start", "b")]


def test_placement_hosts_pins_a_deployment_to_the_hosts_it_names() -> None:
    pinned = deployment("m", placement={"hosts": ["a"]})
    snapshot = two_hosts(host("a"), host("b", 48 * GiB), records=[pinned], demands={"m": NOW})
    assert [(x.kind, x.host) for x in plan(snapshot)] == [("start", "a")]


def test_a_drained_host_takes_no_new_model() -> None:
    snapshot = two_hosts(host("a", 48 * GiB, drained=True), host("b"), demands={"m": NOW})
    assert [(x.kind, x.host) for x in plan(snapshot)] == [("start", "b")]


def test_a_model_pinned_to_drained_hosts_is_refused_at_once() -> None:
    pinned = deployment("m", placement={"hosts": ["a"]})
    snapshot = two_hosts(host("a", drained=True), host("b"), records=[pinned], demands={"m": NOW})
    [refusal] = plan(snapshot)
    assert (refusal.kind, refusal.error) == ("refuse", "host_drained")
    assert "capyctl undrain host NAME" in refusal.reason


def test_a_lapsed_heartbeat_marks_a_joined_host_unreachable_and_a_beat_marks_it_back() -> None:
    lapsed = plan(two_hosts(host("a", alive=False), host("b")))
    assert [(x.kind, x.host) for x in lapsed] == [("mark_unreachable", "a")]
    back = plan(two_hosts(host("a", unreachable_since=NOW - 5), host("b")))
    assert [(x.kind, x.host) for x in back] == [("mark_reachable", "a")]


def test_a_revoked_host_is_marked_unreachable_and_stays_so() -> None:
    revoked = plan(two_hosts(host("a", revoked=True), host("b")))
    assert [(x.kind, x.host) for x in revoked] == [("mark_unreachable", "a")]
    marked = host("a", revoked=True, unreachable_since=NOW - 5)
    assert plan(two_hosts(marked, host("b"))) == []


def test_the_standalone_roles_own_host_is_never_marked() -> None:
    own = replace(host("a", alive=False), joined=False)
    assert plan(two_hosts(own, host("b"))) == []


def test_a_request_for_a_model_on_an_unreachable_host_waits_when_another_host_may_take_it() -> None:
    a = host("a", alive=False, unreachable_since=NOW - 5)
    [wait] = plan(two_hosts(a, host("b"), [on(a, "m", S.READY)], demands={"m": NOW}))
    assert wait.kind == "wait"
    assert "host a is unreachable (no heartbeat for 5s)" in wait.reason
    assert "starts on another host once the host is gone for 30s" in wait.reason


def test_a_request_for_a_model_pinned_to_an_unreachable_host_is_refused_at_once() -> None:
    a = host("a", alive=False, unreachable_since=NOW - 5)
    pinned = deployment("m", placement={"hosts": ["a"]})
    snapshot = two_hosts(a, host("b"), [on(a, "m", S.READY)], records=[pinned], demands={"m": NOW})
    [refusal] = plan(snapshot)
    assert (refusal.kind, refusal.error) == ("refuse", "host_unreachable")
    assert "serves again once the host is back" in refusal.reason


def test_nothing_is_sent_to_an_unreachable_host() -> None:
    """No idle park, no stop of an orphan: its state is unknown until it comes back."""
    a = host("a", alive=False, unreachable_since=NOW - 5)
    idle = deployment("m", lifecycle={"ready_idle_timeout": "1s"})
    orphan = on(a, "gone", S.READY)
    snapshot = two_hosts(a, host("b"), [on(a, "m", S.READY)], records=[idle], orphans=(orphan,))
    assert plan(snapshot) == []


def test_once_a_host_is_gone_its_deployments_start_elsewhere() -> None:
    """The observer leaves a gone host's instances out (stranded): the model starts anew on
    another host, with a newer generation, so the old engine is an orphan once it is back."""
    a = host("a", alive=False, unreachable_since=NOW - 40)
    snapshot = two_hosts(a, host("b"), [], stranded=(on(a, "m", S.READY),), demands={"m": NOW})
    [start] = plan(snapshot)
    assert (start.kind, start.host, start.generation) == ("start", "b", 2)


def test_a_gone_hosts_engines_stay_charged_as_unknown_while_its_gpu_is_seen() -> None:
    """A host revoked (or lost) while its reading still comes: its engine, documented to run
    on, keeps its GPU charged, as unknown, not freed the moment the host is cut off."""
    a = host("a", revoked=True, unreachable_since=NOW)
    snapshot = two_hosts(a, host("b"), [], stranded=(on(a, "m", S.READY),))
    [gpu_a] = [gpu for gpu in gpu_memory(snapshot).gpus if gpu.host == "a"]
    assert gpu_a.charged == {"unknown": 24 * GiB}
    assert gpu_a.free == 0


def test_a_quiet_plan_looks_again_soon_while_hosts_are_joined() -> None:
    snapshot = two_hosts(host("a"), host("b"))
    assert quiet_until(snapshot, plan(snapshot)) == NOW + HOST_CHECK_S


def test_an_effect_sent_to_a_host_that_is_gone_expires() -> None:
    a = host("a", alive=False, unreachable_since=NOW - 40)
    launch = Inflight(
        kind="launch", host="a", gpu="gpu0", generation=2, sent_at=NOW - 41, reason="demanded"
    )
    record = deployment("m", inflight=launch)
    actions = plan(two_hosts(a, host("b"), records=[record], demands={"m": NOW}))
    assert [(x.kind, x.host) for x in actions][:1] == [("settle", "")]
    assert [(x.kind, x.host) for x in actions][1:] == [("start", "b")]


def test_a_model_only_an_unreachable_host_has_is_refused_at_once() -> None:
    """The other host may run it by placement but lacks its folder: nowhere else can take
    it, so its requests fail now instead of waiting out the grace and then the deadline."""
    a = host("a", alive=False, unreachable_since=NOW - 5)
    b = host("b")
    missing = Binding("b", error=NotFound("no folder 'm' under the models root of host b"))
    for instances in ([on(a, "m", S.READY)], []):
        snapshot = replace(
            two_hosts(a, b, instances, demands={"m": NOW}),
            bindings={"m": {"a": bound(a), "b": missing}},
        )
        [refusal] = plan(snapshot)
        assert (refusal.kind, refusal.error) == ("refuse", "host_unreachable")
