"""Lifecycle metrics after a scripted start, park, wake and switch on one simulated GPU: each
operation's duration (the switch's too), the engines' own part of it apart from CapyCTL's,
how long requests waited for their model to become ready, evictions by cause, the queue
gauges, and the GPU's memory by phase as status shows it; the whole exposition checked by
promtool where it is installed, else by prometheus-client's parser, and its names by
Prometheus's conventions."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections import defaultdict
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from capycommon.domain.instances import Event
from cluster import FOURTEEN, HOST, Cluster
from support import wait_for

HI: list[Any] = [{"role": "user", "content": "hi"}]
Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]
# What the GPU gauges say of gpu0 besides its charges, by the field of `list hosts`.
FIGURES = {
    "capyctl_gpu_capacity_bytes": "capacity",
    "capyctl_gpu_managed_limit_bytes": "managed_limit",
    "capyctl_gpu_reserve_bytes": "free_reserve",
    "capyctl_gpu_parked_limit_bytes": "parked_limit",
}


def scrape(cluster: Cluster) -> str:
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    answer = httpx.get(f"http://{cluster.role.inference}/metrics", headers=headers, timeout=10)
    assert answer.status_code == 200
    return answer.text


def samples(text: str) -> Samples:
    """Each sample's value by its name and labels."""
    found: Samples = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return found


def value(found: Samples, name: str, **labels: str) -> float:
    return found[name].get(tuple(sorted(labels.items())), 0.0)


def check_exposition(text: str) -> None:
    """The exposition is valid (promtool where installed, else prometheus-client's parser),
    and named by Prometheus's conventions: our prefix, help texts, counters in _total,
    histograms in base units."""
    promtool = shutil.which("promtool")
    if promtool is not None:
        checked = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
    families = list(text_string_to_metric_families(text))  # raises on a malformed line
    assert families
    for family in families:
        assert family.name.startswith("capyctl_"), family.name
        assert family.documentation, f"{family.name} has no help text"
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        if family.type == "histogram":
            assert family.name.endswith(("_seconds", "_bytes")), f"{family.name}: base units"
        if family.type == "gauge" and family.name.startswith("capyctl_gpu_"):
            assert family.name.endswith("_bytes"), f"{family.name}: base units"


def test_start_park_wake_and_switch_are_measured_with_the_engines_part_apart(
    cluster: Cluster,
) -> None:
    cluster.deploy("a", model="m14", engine_config=FOURTEEN)
    cluster.deploy("b", model="m14", engine_config=FOURTEEN)
    client = cluster.openai()
    client.chat.completions.create(model="a", messages=HI, max_tokens=2)  # a starts
    cluster.ok("park", "deployment", "a", "--wait")
    client.chat.completions.create(model="a", messages=HI, max_tokens=2)  # a wakes
    client.chat.completions.create(model="b", messages=HI, max_tokens=2)  # a parks, b starts
    assert cluster.state("a") == "parked"
    expected = {
        ("a", "start"): 1,
        ("a", "park"): 2,
        ("a", "wake"): 1,
        ("b", "start"): 1,
        ("b", "switch"): 1,
    }
    evicted = {("a", "operator"): 1.0, ("a", "switch"): 1.0}

    def counted() -> Samples | None:
        found = samples(scrape(cluster))
        done = all(
            value(found, "capyctl_lifecycle_engine_seconds_count", deployment=d, operation=o) == n
            for (d, o), n in expected.items()
        ) and all(
            value(found, "capyctl_evictions_total", deployment=d, reason=r) == n
            for (d, r), n in evicted.items()
        )
        return found if done else None

    found = wait_for(counted, timeout=15, what="the router to read every lifecycle event")
    for (deployment, operation), count in expected.items():
        labels = {"deployment": deployment, "operation": operation}
        total = value(found, "capyctl_lifecycle_seconds_sum", **labels)
        engine = value(found, "capyctl_lifecycle_engine_seconds_sum", **labels)
        overhead = value(found, "capyctl_lifecycle_overhead_seconds_sum", **labels)
        assert value(found, "capyctl_lifecycle_seconds_count", **labels) == count
        assert value(found, "capyctl_lifecycle_overhead_seconds_count", **labels) == count
        assert 0 < engine <= total, (labels, engine, total)
        assert math.isclose(engine + overhead, total, abs_tol=1e-6), labels
    # The simulator loads for 0.5 s, so a start's engine part is at least that.
    assert (
        value(found, "capyctl_lifecycle_engine_seconds_sum", deployment="b", operation="start")
        >= 0.5
    )
    # Three requests found their model not ready and waited: a's for its start and for its
    # wake, b's for its start (the switch).
    assert value(found, "capyctl_ready_wait_seconds_count", deployment="a") == 2
    assert value(found, "capyctl_ready_wait_seconds_count", deployment="b") == 1
    # a was evicted twice, once by the operator's park and once by the switch, each counted
    # once (its drain and its park are one eviction), and nothing else was.
    assert {
        (dict(labels)["deployment"], dict(labels)["reason"]): n
        for labels, n in found["capyctl_evictions_total"].items()
    } == evicted
    check_switch(cluster, found)
    # Nothing runs or waits now; b's requests waited in the queue during the switch.
    for name in ("capyctl_requests_running", "capyctl_requests_waiting"):
        assert (("deployment", "b"),) in found[name], name
        assert all(n == 0 for n in found[name].values()), name
    check_gpu(cluster)
    check_exposition(scrape(cluster))


def check_switch(cluster: Cluster, found: Samples) -> None:
    """The switch to b as the scheduler decided it, and what it holds: a's park (its sleep
    call) and b's start (its load), one after the other."""
    (switched,) = [d for d in cluster.choices("b") if d["kind"] == "switched"]
    labels = {"deployment": "b", "operation": "switch"}
    total = value(found, "capyctl_lifecycle_seconds_sum", **labels)
    engine = value(found, "capyctl_lifecycle_engine_seconds_sum", **labels)
    assert math.isclose(total, switched["duration_s"], abs_tol=1e-6)
    assert math.isclose(engine, switched["engine_s"], abs_tol=1e-6)
    park = last(cluster.events("a"), ("parking", "parked"))
    start = last(cluster.events("b"), ("starting", "ready"))
    assert park.engine_s
    assert start.engine_s
    assert math.isclose(engine, park.engine_s + start.engine_s, abs_tol=0.002)
    took = (park.duration_s or 0.0) + (start.duration_s or 0.0)
    assert total >= took - 0.002, "the park, then the start"


def last(events: list[Event], states: tuple[str, str]) -> Event:
    return [e for e in events if (e.from_state, e.to_state) == states][-1]


def check_gpu(cluster: Cluster) -> None:
    """gpu0's bytes by phase are the charges status shows (b ready, a parked), and its
    figures those of `list hosts`."""
    charges: dict[str, int] = defaultdict(int)
    for name in ("a", "b"):
        for charge in cluster.status(name)["charges"]:
            if charge["domain"] == "gpu0":
                charges[charge["phase"]] += charge["bytes"]
    assert set(charges) == {"ready", "parked"}
    (row,) = json.loads(cluster.ok("list", "hosts", "--json"))
    (gpu0,) = [d for d in row["domains"] if d["name"] == "gpu0"]
    at = {"host": HOST, "gpu": "gpu0"}

    def by_phase() -> Samples | None:
        found = samples(scrape(cluster))
        phases = {
            dict(labels)["phase"]: n
            for labels, n in found["capyctl_gpu_memory_bytes"].items()
            if dict(labels)["gpu"] == "gpu0"
        }
        return found if {p: n for p, n in phases.items() if n} == charges else None

    found = wait_for(by_phase, timeout=10, what="the GPU's charges as status shows them")
    assert sum(charges.values()) == gpu0["charged"]
    for name, field in FIGURES.items():
        assert value(found, name, **at) == gpu0[field], name
    ceiling = min(gpu0["managed_limit"], gpu0["capacity"] - gpu0["free_reserve"])
    assert value(found, "capyctl_gpu_free_bytes", **at) == ceiling - gpu0["charged"]


def test_the_exposition_is_valid_and_named_by_prometheus_conventions(cluster: Cluster) -> None:
    cluster.deploy("named", model="small", engine_config={"memory": {"request": "4GiB"}})
    cluster.openai().chat.completions.create(model="named", messages=HI, max_tokens=2)
    check_exposition(scrape(cluster))
