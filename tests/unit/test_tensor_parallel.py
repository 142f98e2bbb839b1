"""Models across several GPUs of one host: what a deployment may declare, what each GPU of its
set is charged, where placement puts it, how switches make room for it and after it, and the
launch that starts it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

import pytest

from capycommon.deployments import HostFacts, parse_deployment, resolve, revision_digest
from capycommon.domain import commands as hc
from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.domain.memory import Link
from capycommon.domain.models import HostModels, ModelFacts
from capycommon.domain.places import Places
from capycommon.engines.adapters import adapter_for
from capycommon.engines.families import Family
from capycommon.engines.launch import LaunchSpec
from capycommon.errors import CapyError
from capycommon.state.hostcommands import encode, parse
from capyctl_scheduler import gpusets, placement
from capyctl_scheduler.actions import Action, park
from capyctl_scheduler.charges import charged
from capyctl_scheduler.launchcommand import launch_command
from capyctl_scheduler.ledger import SYSTEM, derive_domains
from capyctl_scheduler.policy import plan
from capyctl_scheduler.sizing import engine_footprints
from capyctl_scheduler.snapshot import Binding, HostView, Snapshot
from support import deployment_record as record
from support import engine_profile, instance_record
from unit.launches import ROOT, resolved
from unit.readings import idle_reading

GiB = 1 << 30
HOST = "local"
S = InstanceState
FOUR = HostFacts(unified=False, parked_room=32 * GiB, gpus=("gpu0", "gpu1", "gpu2", "gpu3"))


def facts(heads: int | None = 32, kv: int | None = 8) -> HostModels:
    model = ModelFacts(
        path=f"{ROOT}/m", kind="folder", weights_bytes=20 * GiB, attention_heads=heads, kv_heads=kv
    )
    return HostModels(models_root=ROOT, models={"m": model})


def refused(family: Family = Family.VLLM, host: HostFacts = FOUR, **document: Any) -> CapyError:
    with pytest.raises(CapyError) as caught:
        resolve_one(family, host, **document)
    return caught.value


def resolve_one(family: Family, host: HostFacts = FOUR, **document: Any) -> Any:
    profile = engine_profile(family)
    if family in (Family.LLAMACPP, Family.TENSORFOLD):
        document.setdefault("engine_config", {}).setdefault("context_length", 8192)
    if family in (Family.TENSORFOLD,):
        document.setdefault("resources", {"gpu": "10GiB", "ram": "4GiB"})
    models = document.pop("models", facts())
    deployment = parse_deployment(
        {"name": "m", "engine": profile.name, "model": "m", **document}, "t"
    )
    return resolve(deployment, profiles={profile.name: profile}, models=models, host=host)


# --- declaring it ------------------------------------------------------------------------


def test_a_span_is_declared_by_its_size_or_by_the_devices_it_names() -> None:
    by_size = parse_deployment(
        {"name": "m", "engine": "vllm", "model": "m", "engine_config": {"tensor_parallel": 2}}, "t"
    )
    by_devices = parse_deployment(
        {"name": "m", "engine": "vllm", "model": "m", "devices": [{"id": "gpu2"}, {"id": "gpu3"}]},
        "t",
    )
    assert (by_size.gpu_count, by_size.pinned) == (2, ())
    assert (by_devices.gpu_count, by_devices.pinned) == (2, ("gpu2", "gpu3"))
    plain = parse_deployment({"name": "m", "engine": "vllm", "model": "m"}, "t")
    assert plain.gpu_count == 1
    canonical = plain.model_dump(mode="json")
    del canonical["placement"], canonical["lmcache"], canonical["lmcache_pool"]
    del canonical["api"], canonical["resources"], canonical["engine_config"]["tensor_parallel"]
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert revision_digest(plain) == "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    assert revision_digest(by_size) != revision_digest(plain), "a span is a new revision"


def test_a_size_that_disagrees_with_the_devices_named_is_refused() -> None:
    with pytest.raises(CapyError) as caught:
        parse_deployment(
            {
                "name": "m",
                "engine": "vllm",
                "model": "m",
                "devices": [{"id": "gpu0"}, {"id": "gpu1"}],
                "engine_config": {"tensor_parallel": 4},
            },
            "t",
        )
    assert caught.value.code == "tensor_parallel_invalid"
    assert "tensor_parallel is 4 but devices names 2 GPUs" in caught.value.message


@pytest.mark.parametrize("family", [Family.VLLM, Family.SGLANG])
def test_a_size_that_does_not_divide_the_attention_heads_is_refused_with_sizes_that_do(
    family: Family,
) -> None:
    error = refused(family, engine_config={"tensor_parallel": 3})
    assert error.code == "tensor_parallel_invalid"
    assert error.exit_code == 2
    assert "splits the model's 32 attention heads over its GPUs, and 3 does not divide 32" in (
        error.message
    )
    assert "use 1 or 2 or 4" in error.message


def test_the_key_value_heads_must_divide_the_size_or_be_divided_by_it() -> None:
    error = refused(engine_config={"tensor_parallel": 4}, models=facts(heads=32, kv=6))
    assert error.code == "tensor_parallel_invalid"
    assert "6 key-value heads" in error.message
    # Fewer KV heads than ranks: vLLM replicates them, when the size is a multiple.
    assert resolve_one(Family.VLLM, engine_config={"tensor_parallel": 4}, models=facts(32, 2))
    assert resolve_one(Family.VLLM, engine_config={"tensor_parallel": 2}, models=facts(None, None))


def test_llama_cpp_splits_layers_and_runs_any_size() -> None:
    found = resolve_one(Family.LLAMACPP, engine_config={"tensor_parallel": 3})
    assert found.deployment.gpu_count == 3


def test_an_engine_run_on_one_gpu_a_unified_host_and_a_small_host_refuse_a_span() -> None:
    error = refused(Family.TENSORFOLD, engine_config={"tensor_parallel": 2})
    assert (error.code, error.exit_code) == ("multi_gpu_unsupported", 5)
    assert "tensorfold engines run on one GPU" in error.message
    unified = HostFacts(unified=True, parked_room=32 * GiB, gpus=("gpu0",))
    assert refused(host=unified, engine_config={"tensor_parallel": 2}).code == (
        "multi_gpu_unsupported"
    )
    error = refused(engine_config={"tensor_parallel": 8})
    assert error.code == "not_enough_gpus"
    assert "it spans 8 GPUs and this host has 4 (gpu0, gpu1, gpu2, gpu3)" in error.message
    error = refused(devices=[{"id": "gpu1"}, {"id": "gpu9"}])
    assert "devices[1].id: gpu9 is not on this host" in error.message


def test_lmcache_is_off_for_a_span_and_refused_when_required() -> None:
    found = resolve_one(Family.VLLM, engine_config={"tensor_parallel": 2})
    assert found.cache is None
    assert found.cache_note.endswith("[tensor_parallel]")
    error = refused(engine_config={"tensor_parallel": 2}, lmcache="required")
    assert error.code == "lmcache_unavailable:tensor_parallel"


# --- the engines' flags ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "flags"),
    [
        (Family.VLLM, ["--tensor-parallel-size", "2"]),
        (Family.SGLANG, ["--tp-size", "2"]),
        (Family.LLAMACPP, ["--split-mode", "layer", "--tensor-split", "1,1"]),
    ],
)
def test_each_engine_is_told_its_size_by_its_own_flag(
    family: Family, flags: list[str], tmp_path: Any
) -> None:
    tuning = hc.EngineTuning(tensor_parallel=2, context_length=8192)
    model = tmp_path / "m.gguf" if family == Family.LLAMACPP else tmp_path
    if family == Family.LLAMACPP:
        model.write_bytes(b"GGUF")
    spec = LaunchSpec(
        profile=engine_profile(family),
        model_path=model,
        served_name="m",
        port=8100,
        api_key="k",
        residency=adapter_for(family).capabilities(engine_profile(family).version).residencies[0],
        runtime_dir=tmp_path,
        tuning=tuning,
    )
    argv = adapter_for(family).plan(spec).argv
    at = argv.index(flags[0])
    assert argv[at : at + len(flags)] == flags
    single = replace(spec, tuning=hc.EngineTuning(context_length=8192))
    assert flags[0] not in adapter_for(family).plan(single).argv, "one GPU: no flag"


# --- what each GPU is charged ---------------------------------------------------------------


def host(links: dict[tuple[int, int], Link] | None = None, gpus: int = 4) -> HostView:
    reading = idle_reading(*((24 * GiB, False) for _ in range(gpus)), ram=256 * GiB)
    domains = {domain.name: domain for domain in derive_domains(reading)}
    named = {frozenset((f"gpu{a}", f"gpu{b}")): link for (a, b), link in (links or {}).items()}
    return HostView(
        HOST, domains, {f"gpu{i}": f"GPU-{i}" for i in range(gpus)}, unified=False, links=named
    )


NVLINK_PAIRS: dict[tuple[int, int], Link] = {(0, 1): "nvlink", (2, 3): "nvlink"}


def bound(view: HostView, name: str, weights: int, **document: Any) -> Binding:
    facts = HostFacts(unified=False, parked_room=32 * GiB, gpus=tuple(sorted(view.gpus)))
    found = resolved(Family.VLLM, weights, name=name, host=facts, **document)
    return Binding(HOST, found, engine_footprints(found, view))


def test_each_gpu_of_a_set_is_charged_its_ranks_share_and_host_ram_once() -> None:
    view = host()
    whole = bound(view, "big", 30 * GiB, engine_config={"tensor_parallel": 2}, residency="deep")
    one = bound(view, "small", 15 * GiB, residency="deep")
    assert set(whole.footprints) == {"gpu0+gpu1", "gpu0+gpu2", "gpu0+gpu3", "gpu1+gpu2"} | {
        "gpu1+gpu3",
        "gpu2+gpu3",
    }
    ready = whole.footprints["gpu0+gpu1"].charge("ready")
    # A rank of a 30 GiB model holds what a 15 GiB model holds on its one GPU.
    assert ready["gpu0"] == ready["gpu1"] == one.footprints["gpu0"].charge("ready")["gpu0"]
    assert ready[SYSTEM] == 2 * one.footprints["gpu0"].charge("ready")[SYSTEM], "a rank each"
    backed = bound(
        view, "big", 30 * GiB, engine_config={"tensor_parallel": 2}, residency="host_backed"
    )
    copy = backed.footprints["gpu0+gpu1"].charge("parked")[SYSTEM] - ready[SYSTEM]
    assert copy == 45 * GiB, "the host copy of the whole model, once"
    parked = whole.footprints["gpu2+gpu3"].charge("parked")
    assert set(parked) == {"gpu2", "gpu3", SYSTEM}
    pinned = bound(view, "big", 30 * GiB, devices=[{"id": "gpu3"}, {"id": "gpu1"}])
    assert list(pinned.footprints) == ["gpu3+gpu1"], "the pinned set only, in its rank order"


# --- placement ------------------------------------------------------------------------------


def running(name: str, state: InstanceState, *gpus: int, since: float = 0.0) -> InstanceRecord:
    uuids = tuple(f"GPU-{gpu}" for gpu in gpus)
    more = uuids if len(uuids) > 1 else ()
    return instance_record(
        name, HOST, state=state, since=since, gpu_uuid=uuids[0], gpu_uuids=more, residency="deep"
    )


BIG: dict[str, Any] = {"engine_config": {"tensor_parallel": 2}}


def scene(
    view: HostView,
    records: list[tuple[DeploymentRecord, int]],
    instances: list[InstanceRecord] = (),  # type: ignore[assignment]
    now: float = 100.0,
    **fields: Any,
) -> Snapshot:
    """`records`, each with its model's weights, bound on `view`."""
    bindings = {
        r.name: {HOST: bound(view, r.name, weights, **r.document.model_dump(include=_DOC))}
        for r, weights in records
    }
    return Snapshot(
        now=now,
        deployments={r.name: r for r, _ in records},
        instances={i.deployment: i for i in instances},
        hosts={HOST: view},
        bindings=bindings,
        **fields,
    )


_DOC = {"devices", "engine_config", "residency"}


def test_the_tightest_set_wins_and_a_fuller_pair_loses_to_a_free_one() -> None:
    view = host(NVLINK_PAIRS | {(0, 2): "node", (1, 3): "node", (0, 3): "system", (1, 2): "system"})
    big = record("big", **BIG)
    free = scene(view, [(big, 30 * GiB)])
    chosen = placement.best(free, big, {HOST: charged(free, HOST)})
    assert chosen is not None
    assert chosen.gpu == "gpu0+gpu1", "NVLink, and the lowest indices of the two pairs"
    why = placement.explain(free, big, chosen)
    assert "all nvlink" in why
    assert "not local gpu2+gpu3" in why
    # A small model holds gpu1: gpu2+gpu3 still has room for the whole span on NVLink.
    small = record("small")
    held = scene(view, [(big, 30 * GiB), (small, 15 * GiB)], [running("small", S.READY, 1)])
    chosen = placement.best(held, big, {HOST: charged(held, HOST)})
    assert chosen is not None
    assert chosen.gpu == "gpu2+gpu3"


def test_with_no_topology_the_set_with_the_most_headroom_wins() -> None:
    view = host()
    big, small = record("big", **BIG), record("small")
    held = scene(view, [(big, 20 * GiB), (small, 4 * GiB)], [running("small", S.READY, 0)])
    chosen = placement.best(held, big, {HOST: charged(held, HOST)})
    assert chosen is not None
    assert chosen.gpu == "gpu1+gpu2", "gpu0 is charged; of the free sets, the lowest indices"
    assert "topology unknown" in placement.explain(held, big, chosen)


def test_a_start_across_two_gpus_names_both_and_waits_for_a_start_on_either() -> None:
    view = host(gpus=2)
    big, small = record("big", **BIG), record("small")
    cold = scene(view, [(big, 20 * GiB)], demands={"big": 99.0})
    (start,) = plan(cold)
    assert (start.kind, start.gpu, start.generation) == ("start", "gpu0+gpu1", 2)
    command = launch_command(cold, big, start)
    assert (command.gpu_uuid, command.gpu_uuids, command.tensor_parallel) == (
        "GPU-0",
        ("GPU-0", "GPU-1"),
        2,
    )
    assert parse(encode(command)) == command
    busy = scene(
        view,
        [(big, 20 * GiB), (small, 4 * GiB)],
        [running("small", S.STARTING, 1)],
        demands={"big": 99.0},
    )
    actions = plan(busy)
    assert [a.kind for a in actions] == ["wait"]
    assert "starts are one at a time on gpu1: small is starting" in actions[0].reason


def test_a_one_gpu_launch_leaves_the_later_fields_out_for_an_earlier_host() -> None:
    view = host(gpus=2)
    small = record("small")
    cold = scene(view, [(small, 4 * GiB)], demands={"small": 99.0})
    (start,) = plan(cold)
    sent = json.loads(encode(launch_command(cold, small, start)))
    assert "gpu_uuids" not in sent
    assert "tensor_parallel" not in sent
    assert sent["gpu_uuid"] == "GPU-0"


# --- switches -------------------------------------------------------------------------------


def test_a_two_gpu_model_evicts_the_models_of_both_its_gpus_and_they_evict_it_back() -> None:
    view = host(gpus=2)
    big, one, two = (record("big", **BIG), record("one"), record("two"))
    weights = [(big, 30 * GiB), (one, 15 * GiB), (two, 15 * GiB)]
    both = [running("one", S.READY, 0, since=10.0), running("two", S.READY, 1, since=20.0)]
    actions = plan(scene(view, weights, both, demands={"big": 99.0}))
    drained = {a.deployment for a in actions if a.kind == "drain"}
    assert drained == {"one", "two"}, "one model on each GPU of the set"
    (switch,) = [a for a in actions if a.kind == "wait" and a.victims]
    assert "on gpu0+gpu1" in switch.reason
    # And back: the two-GPU model ready, a one-GPU model demanded evicts it.
    ready = [running("big", S.READY, 0, 1, since=30.0)]
    actions = plan(scene(view, weights, ready, demands={"one": 99.0}))
    assert [(a.kind, a.deployment, a.gpu) for a in actions if a.kind == "drain"] == [
        ("drain", "big", "gpu0+gpu1")
    ]


def test_a_model_with_waiting_requests_is_never_a_victim() -> None:
    view = host(gpus=2)
    big, one, two = (record("big", **BIG), record("one"), record("two"))
    weights = [(big, 30 * GiB), (one, 15 * GiB), (two, 15 * GiB)]
    both = [running("one", S.READY, 0, since=10.0), running("two", S.READY, 1, since=20.0)]
    busy = Places(generation=1, running=1)
    actions = plan(scene(view, weights, both, demands={"big": 99.0}, places={"two": busy}))
    assert not [a for a in actions if a.kind == "drain"], "two is busy: nothing is evicted"
    assert any("insufficient_resources" in a.reason for a in actions if a.kind == "wait")


def test_a_parked_two_gpu_model_wakes_on_its_own_set_with_a_bound_per_gpu() -> None:
    view = host(gpus=4)
    big = record("big", **BIG)
    parked = scene(view, [(big, 30 * GiB)], [running("big", S.PARKED, 2, 3)], demands={"big": 9})
    (wake,) = plan(parked)
    assert (wake.kind, wake.gpu) == ("wake", "gpu2+gpu3")
    ready = scene(view, [(big, 30 * GiB)], [running("big", S.READY, 2, 3)])
    action: Action = park(ready, ready.instances["big"], "idle")
    footprint = ready.bindings["big"][HOST].footprints["gpu2+gpu3"]
    assert action.release_bound == footprint.charge("parked")["gpu2"], "one GPU's share"
    assert gpusets.members(action.gpu) == ("gpu2", "gpu3")


def test_the_reasons_placement_gives_stay_short_however_many_hosts_lose() -> None:
    view = host(gpus=2)
    big = record("big", **BIG)
    one = scene(view, [(big, 20 * GiB)])
    names = [f"host-{i:02d}-{'x' * 50}" for i in range(40)]
    down = {name: replace(view, name=name, alive=False) for name in names}
    bindings = {"big": {**one.bindings["big"], **dict.fromkeys(names, one.bindings["big"][HOST])}}
    many = replace(one, hosts={**one.hosts, **down}, bindings=bindings)
    ledgers = {name: charged(many, name) for name in many.hosts}
    chosen = placement.best(many, big, ledgers)
    assert chosen is not None
    assert chosen.host == HOST
    why = placement.explain(many, big, chosen)
    assert len(why) <= placement.MAX_WHY
    assert "its hostd is not running" in why
    DeploymentRecord.model_validate({**big.model_dump(), "placed": why})
