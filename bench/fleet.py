"""The control plane at fleet scale: a real server role (Redis, scheduler, router, status
page) against stand-in hosts (`enginesim.standin`, joined as real hosts join, 8 GPUs of
80 GiB each) and declared deployments, at each size of `--sizes` (hosts:deployments).

For each size it prints, over `--seconds` of the fleet at rest once declared:
- the scheduler's ticks: p50, p99 and mean CPU (as the leader writes them, `capyctl status`);
- Redis: commands a second and its CPU (a share of one core), and the bytes it holds;
- the scheduler's and the router's CPU (a share of one core), and the router's RSS;
- `list deployments` through the management API: p50 and p99, and the answer's size;
- the status page: p50 and its size;
- a new deployment listed by the router (`GET /v1/models`): p50 and the most, over five;
and then how each grows from the smallest size to the largest, beside the hosts' growth.

    .venv/bin/python bench/fleet.py                       # 10:100, 30:300, 100:1000
    .venv/bin/python bench/fleet.py --sizes 3:10 --seconds 3     # the smoke test's size

The steady request mix that wakes and switches models is not driven yet: the stand-ins serve
no inference traffic (their records name ports nobody serves)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import fleetstand
import fleetwatch

import ingressstand
from capycommon.paths import StatePaths
from capyctl_cli.gpucheck.role import stop_group
from capyctl_cli.management import Management

Size = tuple[int, int]  # hosts, deployments


def sizes(text: str) -> list[Size]:
    """`10:100,30:300` as [(10, 100), (30, 300)]."""
    return [(int(h), int(d)) for h, _, d in (each.partition(":") for each in text.split(","))]


def measure(size: Size, seconds: float, root: Path) -> dict[str, float]:
    roles: dict[str, ingressstand.Role] = {}
    fleet = None
    try:
        server = ingressstand.start_server(root / "server", roles)
        began = time.monotonic()
        folders = fleetstand.join(server, root, size[0])
        joined_s = time.monotonic() - began
        fleet = fleetstand.start_hosts(folders, root / "hosts.log")
        watch = fleetwatch.Watch(server)
        watch.wait_for_hosts(size[0], fleet)
        with Management(StatePaths(server.state)) as api:
            for index in range(size[1]):
                api.deploy({"name": f"d{index:04d}", "engine": "vllm", "model": f"m{index % 20}"})
        watch.settle()
        figures = watch.at_rest(seconds)
        figures |= watch.listing(server)
        figures |= watch.propagation(server, 5)
        figures["join_ms_per_host"] = joined_s / size[0] * 1000
        return figures
    finally:
        if fleet is not None:
            stop_group(fleet, 10)
        for role in roles.values():
            role.stop()


ROWS = (
    ("tick p50, ms", "tick_p50_ms"),
    ("tick p99, ms", "tick_p99_ms"),
    ("tick CPU, ms", "tick_cpu_ms"),
    ("Redis commands/s", "redis_ops"),
    ("Redis CPU, % of a core", "redis_cpu"),
    ("Redis MiB", "redis_mib"),
    ("scheduler CPU, %", "scheduler_cpu"),
    ("router CPU, %", "router_cpu"),
    ("router RSS, MiB", "router_mib"),
    ("list deployments p50, ms", "list_p50_ms"),
    ("list deployments p99, ms", "list_p99_ms"),
    ("list deployments KiB", "list_kib"),
    ("status page p50, ms", "page_p50_ms"),
    ("status page KiB", "page_kib"),
    ("new deployment at the router p50, ms", "listed_p50_ms"),
    ("new deployment at the router max, ms", "listed_max_ms"),
    ("join, ms a host", "join_ms_per_host"),
)


def show(results: dict[Size, dict[str, float]]) -> None:
    sizes = list(results)
    head = "".join(f"{f'{h} h, {d} d':>16}" for h, d in sizes)
    grows = len(sizes) > 1
    print(f"\n{'':40}{head}" + (f"{'growth':>10}" if grows else ""))
    for label, key in ROWS:
        values = [results[s].get(key, float("nan")) for s in sizes]
        line = f"{label:40}" + "".join(f"{v:16.1f}" for v in values)
        if grows and values[0] > 0:
            line += f"{values[-1] / values[0]:9.1f}x"
        print(line)
    if grows:
        grown = sizes[-1][0] / sizes[0][0]
        print(f"{'hosts':40}" + "".join(f"{h:16}" for h, _ in sizes) + f"{grown:9.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10:100,30:300,100:1000")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    results: dict[Size, dict[str, float]] = {}
    for size in sizes(args.sizes):
        root = Path(tempfile.mkdtemp(prefix="capy-fleet-"))
        try:
            print(f"{size[0]} hosts, {size[1]} deployments ...", flush=True)
            results[size] = measure(size, args.seconds, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    show(results)


if __name__ == "__main__":
    main()
