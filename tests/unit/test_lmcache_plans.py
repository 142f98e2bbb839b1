"""The scheduler's plans for a model that runs with LMCache, as pure functions of a snapshot:
its restart_only park stops the engine and keeps the server (charged), which then ends after
the parked idle timeout, at an operator stop, for a new revision, or when its memory is
needed; a server nobody owns any more is stopped."""

from __future__ import annotations

from dataclasses import replace

from capycommon.domain.instances import InstanceRecord
from capyctl_scheduler.charges import charged
from capyctl_scheduler.ledger import GiB
from capyctl_scheduler.policy import plan, quiet_until
from support import cache_record
from unit.test_policy import HOST, S, binding, deployment, instance, kinds, load, snapshot, view

CACHE = cache_record()
IDLE = {"ready_idle_timeout": "5m", "parked_idle_timeout": "30m"}


def cached(state: S, since: float = 0.0, revision: int = 1, generation: int = 1) -> InstanceRecord:
    found = instance(
        "a", state, since=since, residency="restart_only", revision=revision, generation=generation
    )
    return found.model_copy(update={"cache": CACHE})


def test_an_idle_restart_only_model_with_lmcache_parks_by_stopping_and_keeps_its_server() -> None:
    record = deployment("a", lifecycle=IDLE)
    active = {"a": load(1, 0, 400.0, active=100.0)}
    (drain,) = plan(snapshot(400.0, [record], [cached(S.READY)], loads=active))
    assert (drain.kind, drain.then) == ("drain", "park"), "a park, though it cannot sleep"
    draining = cached(S.DRAINING, since=400.0)
    idle = {"a": load(1, 0, 401.0, active=100.0)}
    (stop,) = plan(snapshot(401.0, [record], [draining], loads=idle))
    assert (stop.kind, stop.keep_cache) == ("stop", True)
    assert "a restart_only park" in stop.reason
    plain = instance("a", S.DRAINING, since=400.0, residency="restart_only")
    (stop,) = plan(snapshot(401.0, [record], [plain], loads=idle))
    assert (stop.kind, stop.keep_cache) == ("stop", False), "no server to keep"


def test_a_kept_server_is_charged_and_released_after_the_parked_idle_timeout() -> None:
    record = deployment("a", lifecycle=IDLE)
    kept = [cached(S.STOPPED, since=500.0)]
    quiet = snapshot(2299.0, [record], kept)
    assert kinds(plan(quiet)) == []
    assert quiet_until(quiet, []) == 2300.0
    ledger = charged(quiet, HOST)
    assert ledger.charges["a"] == {"system": 6 * GiB, "gpu0": GiB}
    (release,) = plan(snapshot(2300.0, [record], kept))
    assert (release.kind, release.generation, release.reason) == (
        "release",
        1,
        "parked idle for 30m",
    )


def test_a_kept_server_is_released_at_an_operator_stop_and_for_a_new_revision() -> None:
    kept = [cached(S.STOPPED)]
    (release,) = plan(snapshot(1.0, [deployment("a", stopped=True)], kept))
    assert (release.kind, release.reason) == ("release", "operator stop")
    (release,) = plan(snapshot(1.0, [deployment("a", revision=2)], kept))
    assert (release.kind, release.reason) == ("release", "revision 2 replaces revision 1")


def test_a_demand_starts_the_model_again_beside_its_kept_server() -> None:
    (start,) = plan(snapshot(1.0, [deployment("a")], [cached(S.STOPPED)], demands={"a": 0.5}))
    assert (start.kind, start.generation) == ("start", 2)


def test_a_kept_server_is_released_when_another_model_needs_its_memory() -> None:
    """b needs all of the 24 GiB card's room but for what a's kept server holds there."""
    host = view(24 * GiB)
    records = [deployment("a"), deployment("b")]
    base = snapshot(50.0, records, [cached(S.STOPPED)], host=host, demands={"b": 49.0})
    big = binding(host, request=20 * GiB + GiB // 4)  # 21.5 GiB with its CUDA context
    needing = replace(base, bindings={**base.bindings, "b": {HOST: big}})
    room = charged(needing, HOST).headroom("gpu0")
    assert room < 21 * GiB + GiB // 2 <= room + GiB, "only the kept server is in the way"
    actions = plan(needing)
    assert kinds(actions) == [("release", "a")]
    assert actions[0].reason.startswith("switch to b")
    released = replace(
        needing, instances={"a": cached(S.STOPPED).model_copy(update={"cache": None})}
    )
    assert kinds(plan(released)) == [("start", "b")]


def test_a_kept_server_nobody_owns_is_stopped() -> None:
    orphan = cached(S.STOPPED)
    found = snapshot(1.0, [], orphans=(orphan,))
    (stop,) = plan(found)
    assert (stop.kind, stop.deployment, stop.generation) == ("stop", "a", 1)
    assert charged(found, HOST).charges["orphan:a:0"] == {"system": 6 * GiB, "gpu0": GiB}
