"""How long the scheduler's pure plan takes for 100 deployments on 10 hosts.

`policy.plan(snapshot)` is called on every pass of the planning loop. This builds, in memory,
a snapshot of 10 hosts (four 80 GiB GPUs and 1 TiB of RAM each) and 100 deployments, each
bound on every host: per host, six ready (two of them busy, one idle past its timeout), two
parked, one cold and one stopped instance, and two demands, one of which needs a switch.
It prints the p50 and the max of many plans, beside the same figures for one deployment on
one host (the baseline, measured in the same run), against the target of 10 ms.
tests/unit/test_plan_at_scale.py checks that the plan of this same snapshot is sane.

    .venv/bin/python bench/plan.py [--repeat 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable

from capycommon.deployments import parse_deployment
from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.hosts import EngineLoad
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.domain.memory import GpuReading, HostRam, MemoryReading
from capycommon.engines.families import Family
from capyctl_scheduler.actions import Action
from capyctl_scheduler.engineterms import EngineTerms
from capyctl_scheduler.ledger import GiB, derive_discrete, derive_domains
from capyctl_scheduler.policy import plan
from capyctl_scheduler.snapshot import Binding, HostView, Snapshot

S = InstanceState
TARGET_MS = 10.0
NOW = 100_000.0
GPUS = 4
PER_HOST = 10
# What each deployment's instance is, by its index on its host: (state, GPU, busy).
# vLLM 0.21 and later, which keeps its activations and graphs within the budget it is told,
# with its own 150 MiB of slack; its park keeps its CUDA graph pool (about 1 GiB here).
VLLM = EngineTerms(
    family=Family.VLLM,
    activations=0,
    graphs=GiB,
    activations_inside=True,
    graphs_inside=True,
    kv_fixed=False,
    margin=150 << 20,
    parked_keeps=GiB,
)
LAYOUT: tuple[tuple[S | None, int, bool], ...] = (
    (S.READY, 0, True),
    (S.READY, 0, False),
    (S.READY, 1, True),
    (S.READY, 1, False),
    (S.READY, 2, False),  # idle past the ready timeout: it drains to park
    (S.READY, 3, False),
    (S.PARKED, 2, False),
    (S.PARKED, 3, False),
    (None, 0, False),  # cold, demanded: fits where a GPU has room
    (S.STOPPED, 0, False),  # demanded with a peak that needs a switch
)
# The indices of LAYOUT's idle instance, of its cold one that fits and of the one whose start
# needs a switch.
IDLE, FITS, SWITCH = 4, 8, 9


def _view(host: str) -> HostView:
    reading = MemoryReading(
        host=host,
        taken_at=NOW,
        backend="simulated",
        gpus=[
            GpuReading(
                index=index,
                uuid=f"{host}-GPU-{index}",
                name=f"gpu{index}",
                total_bytes=80 * GiB,
                used_bytes=0,
                free_bytes=80 * GiB,
                unified=False,
            )
            for index in range(GPUS)
        ],
        ram=HostRam(total_bytes=1024 * GiB, available_bytes=1024 * GiB, source="simulated"),
    )
    domains = {domain.name: domain for domain in derive_domains(reading)}
    gpus = {f"gpu{i}": f"{host}-GPU-{i}" for i in range(GPUS)}
    return HostView(host, domains, gpus, unified=False)


def deployment_name(host: int, index: int) -> str:
    """The name of the deployment at `index` of LAYOUT on host number `host`."""
    return f"d{host:02d}{index}"


def _record(name: str, generation: int) -> DeploymentRecord:
    document = {"name": name, "engine": "vllm", "model": name}
    return DeploymentRecord(
        name=name,
        revision=1,
        digest="sha256:x",
        created_at=0.0,
        updated_at=0.0,
        document=parse_deployment(document, "bench"),
        generation=generation,
    )


def _binding(view: HostView, request: int, startup: int) -> Binding:
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


def snapshot(hosts: int, per_host: int = PER_HOST) -> Snapshot:
    """`hosts` hosts with `per_host` deployments each (at most 10), laid out as LAYOUT."""
    views = {f"host{h}": _view(f"host{h}") for h in range(hosts)}
    deployments: dict[str, DeploymentRecord] = {}
    instances: dict[str, InstanceRecord] = {}
    bindings: dict[str, dict[str, Binding]] = {}
    loads: dict[str, EngineLoad] = {}
    demands: dict[str, float] = {}
    for h, (host, view) in enumerate(views.items()):
        for i, (state, gpu, busy) in enumerate(LAYOUT[:per_host]):
            deployment = deployment_name(h, i)
            deployments[deployment] = _record(deployment, generation=1)
            request = (20 + 2 * i) * GiB
            startup = 70 * GiB if i == SWITCH else request + 2 * GiB
            bindings[deployment] = {
                other: _binding(other_view, request, startup) for other, other_view in views.items()
            }
            if state is not None:
                since = NOW - 400 if i == IDLE else NOW - 60
                instances[deployment] = InstanceRecord(
                    deployment=deployment,
                    instance=0,
                    revision=1,
                    generation=1,
                    state=state,
                    since=since,
                    host=host,
                    gpu_uuid=view.gpus[f"gpu{gpu}"],
                    residency="host_backed",
                )
                loads[deployment] = EngineLoad(
                    generation=1,
                    running=1 if busy else 0,
                    waiting=0,
                    last_active_at=NOW - (400 if i == IDLE else 30),
                    read_at=NOW - 0.5,
                )
            if i in (FITS, SWITCH) or per_host == 1:
                demands[deployment] = NOW - 1 - i
    return Snapshot(
        now=NOW,
        deployments=deployments,
        instances=instances,
        hosts=views,
        bindings=bindings,
        loads=loads,
        demands=demands,
    )


def _times(call: Callable[[], object], repeat: int) -> tuple[list[float], list[float]]:
    """Wall-clock and CPU seconds of each of `repeat` calls, after a warm-up. On a busy
    machine the CPU time is the steadier figure: it leaves out the time others ran."""
    for _ in range(max(3, repeat // 10)):
        call()
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.thread_time()
        call()
        wall.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    return wall, cpu


def _summary(actions: list[Action]) -> str:
    counted = Counter(action.kind for action in actions)
    return ", ".join(f"{kind} x {count}" for kind, count in sorted(counted.items()))


def main(repeat: int) -> None:
    big = snapshot(hosts=10)
    small = snapshot(hosts=1, per_host=1)
    assert len(big.deployments) == 100
    assert len(big.hosts) == 10
    base, base_cpu = _times(lambda: plan(small), repeat)
    timed, timed_cpu = _times(lambda: plan(big), repeat)
    print(f"plan() over {repeat} runs, ms{'':<16}{'p50':>9}{'max':>9}{'CPU p50':>9}{'CPU max':>9}")
    rows = (
        ("1 deployment, 1 host (baseline)", base, base_cpu),
        ("100 deployments, 10 hosts", timed, timed_cpu),
    )
    for label, wall, cpu in rows:
        figures = (statistics.median(wall), max(wall), statistics.median(cpu), max(cpu))
        print(f"  {label:<36}" + "".join(f"{figure * 1000:>9.3f}" for figure in figures))
    ratio = statistics.median(timed) / statistics.median(base)
    print(f"  100 x 10 / baseline, p50: {ratio:.0f}")
    print(f"  actions of the 100 x 10 plan: {_summary(plan(big))}")
    p50 = statistics.median(timed) * 1000
    verdict = "met" if p50 <= TARGET_MS else "NOT met"
    print(f"target: a plan of 100 deployments on 10 hosts within {TARGET_MS:g} ms (p50): {verdict}")
    print("(a wall-clock max above the CPU max is time the machine gave to other processes)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=300, help="plans timed (default 300)")
    args = parser.parse_args()
    main(args.repeat)
