"""One plan over 100 deployments on 10 hosts: the actions a small case plans, at scale."""

from __future__ import annotations

from collections import defaultdict

from capycommon.deployments import parse_deployment
from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.hosts import EngineLoad
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.domain.memory import GpuReading, HostRam, MemoryReading
from capycommon.engines.families import Family
from capyctl_scheduler.actions import Action
from capyctl_scheduler.charges import charged
from capyctl_scheduler.ledger import GiB, derive_discrete, derive_domains
from capyctl_scheduler.policy import plan, quiet_until
from capyctl_scheduler.snapshot import Binding, HostView, Snapshot
from unit.launches import terms

S = InstanceState
NOW = 100_000.0
HOSTS = 10
GPUS = 4
# Each host's ten deployments, by index: the instance's state and GPU, and whether it serves.
LAYOUT: list[tuple[InstanceState | None, int, bool]] = [
    (S.READY, 0, True),
    (S.READY, 0, False),
    (S.READY, 1, True),
    (S.READY, 1, False),
    (S.READY, 2, False),  # idle for 400 s: past the 300 s ready idle timeout
    (S.READY, 3, False),
    (S.PARKED, 2, False),
    (S.PARKED, 3, False),
    (None, 0, False),  # cold and demanded: it fits
    (S.STOPPED, 0, False),  # demanded, with a 70 GiB startup peak: a switch
]
IDLE, FITS, SWITCH = 4, 8, 9
VLLM = terms(Family.VLLM, 80 * GiB)


def _view(host: str) -> HostView:
    reading = MemoryReading(
        host=host,
        taken_at=NOW,
        backend="simulated",
        gpus=[
            GpuReading(
                index=i,
                uuid=f"{host}-GPU-{i}",
                name=f"gpu{i}",
                total_bytes=80 * GiB,
                used_bytes=0,
                free_bytes=80 * GiB,
                unified=False,
            )
            for i in range(GPUS)
        ],
        ram=HostRam(total_bytes=1024 * GiB, available_bytes=1024 * GiB, source="simulated"),
    )
    domains = {domain.name: domain for domain in derive_domains(reading)}
    return HostView(host, domains, {f"gpu{i}": f"{host}-GPU-{i}" for i in range(GPUS)}, False)


def _binding(view: HostView, index: int) -> Binding:
    request = (20 + 2 * index) * GiB
    startup = 70 * GiB if index == SWITCH else request + 2 * GiB
    footprints = {
        gpu: derive_discrete(
            gpu=gpu,
            weights=request // 2,
            device=view.domains[gpu],
            host_backed=True,
            terms=VLLM,
            request=request,
            startup=(startup, "declared"),
        )
        for gpu in view.gpus
    }
    return Binding(view.name, footprints=footprints)


def _scene() -> Snapshot:
    views = {f"host{h}": _view(f"host{h}") for h in range(HOSTS)}
    deployments, instances, bindings, loads, demands = {}, {}, {}, {}, {}
    for h, (host, view) in enumerate(views.items()):
        for i, (state, gpu, serving) in enumerate(LAYOUT):
            name = f"d{h}{i}"
            document = parse_deployment({"name": name, "engine": "vllm", "model": name}, "t")
            deployments[name] = DeploymentRecord(
                name=name,
                revision=1,
                digest="sha256:x",
                created_at=0.0,
                updated_at=0.0,
                document=document,
                generation=1,
            )
            bindings[name] = {other: _binding(v, i) for other, v in views.items()}
            if state is not None:
                idle_for = 400 if i == IDLE else 30
                instances[name] = InstanceRecord(
                    deployment=name,
                    instance=0,
                    revision=1,
                    generation=1,
                    state=state,
                    since=NOW - idle_for,
                    host=host,
                    gpu_uuid=view.gpus[f"gpu{gpu}"],
                    residency="host_backed",
                )
                loads[name] = EngineLoad(
                    generation=1,
                    running=int(serving),
                    waiting=0,
                    last_active_at=NOW - idle_for,
                    read_at=NOW - 0.5,
                )
            if i in (FITS, SWITCH):
                demands[name] = NOW - 1 - i
    return Snapshot(
        now=NOW,
        deployments=deployments,
        instances=instances,
        hosts=views,
        bindings=bindings,
        loads=loads,
        demands=demands,
    )


def _by_deployment(actions: list[Action]) -> dict[str, list[Action]]:
    found: dict[str, list[Action]] = defaultdict(list)
    for action in actions:
        found[action.deployment].append(action)
    return found


def test_a_plan_of_100_deployments_on_10_hosts_is_sane() -> None:
    scene = _scene()
    assert (len(scene.deployments), len(scene.hosts)) == (100, 10)
    actions = plan(scene)
    by_name = _by_deployment(actions)
    assert set(by_name) <= set(scene.deployments)

    serving = {f"d{h}{i}" for h in range(HOSTS) for i, (_, _, s) in enumerate(LAYOUT) if s}
    assert not serving & set(by_name), "a model serving requests is never drained or stopped"
    for h in range(HOSTS):
        idle = [a for a in by_name[f"d{h}{IDLE}"] if a.reason == "idle for 5m"]
        assert [(a.kind, a.then) for a in idle] == [("drain", "park")], "idle: it parks"
        for i in (1, 3, 5, 6, 7):
            assert f"d{h}{i}" not in by_name, "an idle model within its timeouts stays"

    starts = [a for a in actions if a.kind == "start"]
    assert sorted(a.deployment for a in starts) == [f"d{h}{FITS}" for h in range(HOSTS)]
    assert len({(a.host, a.gpu) for a in starts}) == len(starts), "one start per GPU"
    for start in starts:
        footprint = scene.bindings[start.deployment][start.host].footprints[start.gpu]
        # Admission raises when the start would break a limit of its GPU or host.
        charged(scene, start.host).admit(start.deployment, footprint.charge("starting"))

    for h in range(HOSTS):
        name = f"d{h}{SWITCH}"
        (wait,) = by_name[name]
        assert wait.kind == "wait"
        assert wait.reason.startswith("switch: releasing ")
        victims = wait.reason.removeprefix("switch: releasing ").split(" to ")[0].split(", ")
        for victim in victims:
            assert victim not in serving
            assert any(
                a.kind == "drain" and a.reason.startswith(f"switch to {name}")
                for a in by_name[victim]
            )
    assert quiet_until(scene, actions) is None, "demands keep the loop at its pace"
