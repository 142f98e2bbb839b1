"""Lifecycle metrics after a scripted start, park, wake and switch on one simulated GPU: each
operation's duration, the engine's own part of it apart from CapyCTL's, and how long
requests waited for their model to become ready; the whole exposition checked by promtool
where it is installed, else by prometheus-client's parser, and its names by Prometheus's
conventions."""

from __future__ import annotations

import math
import shutil
import subprocess
from collections import defaultdict
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cluster import FOURTEEN, Cluster
from support import wait_for

HI: list[Any] = [{"role": "user", "content": "hi"}]
OPERATIONS = ("start", "park", "wake")


def scrape(cluster: Cluster) -> str:
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    answer = httpx.get(f"http://{cluster.role.inference}/metrics", headers=headers, timeout=10)
    assert answer.status_code == 200
    return answer.text


def samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Each sample's value by its name and labels."""
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return found


def value(
    found: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str
) -> float:
    return found[name].get(tuple(sorted(labels.items())), 0.0)


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
    expected = {("a", "start"): 1, ("a", "park"): 2, ("a", "wake"): 1, ("b", "start"): 1}

    def counted() -> dict[str, dict[tuple[tuple[str, str], ...], float]] | None:
        found = samples(scrape(cluster))
        done = all(
            value(found, "capyctl_lifecycle_engine_seconds_count", deployment=d, operation=o) == n
            for (d, o), n in expected.items()
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


def test_the_exposition_is_valid_and_named_by_prometheus_conventions(cluster: Cluster) -> None:
    cluster.deploy("named", model="small", engine_config={"memory": {"request": "4GiB"}})
    cluster.openai().chat.completions.create(model="named", messages=HI, max_tokens=2)
    text = scrape(cluster)
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
