"""What the fleet benchmark (`bench/fleet.py`) reads of the server it runs: Redis's own
counters (INFO), each service's CPU and memory from /proc, the scheduler's tick times as the
leader writes them, and the management API, the status page and the router timed from here."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import cast

import httpx
import redis

import ingressstand
from capycommon import management as wire
from capycommon.domain.leader import PlanTimes
from capycommon.paths import StatePaths
from capycommon.redistarget import CONTROL_USER
from capycommon.state import keys
from capyctl_cli.management import Management
from capyctl_scheduler.plantimes import WRITE_EVERY_S

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pids: list[int]) -> float:
    """The CPU seconds `pids` used so far (user and system)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / TICK


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


class Watch:
    def __init__(self, server: ingressstand.Role) -> None:
        self.server = server
        paths = StatePaths(server.state)
        self.redis = redis.Redis(
            unix_socket_path=str(paths.redis_socket),
            username=CONTROL_USER,
            password=paths.redis_password.read_text().strip(),
        )
        self.pids = {name: server.pids(name) for name in ("scheduler", "router")}

    def wait_for_hosts(self, count: int, fleet: subprocess.Popen[bytes]) -> None:
        """Until every host beats and has a memory reading in the server's Redis."""
        deadline = time.monotonic() + 60 + count
        while True:
            names = [m.decode() for m in cast(set[bytes], self.redis.smembers(keys.hosts()))]
            found = [self.redis.exists(keys.heartbeat("hostd", n), keys.memory(n)) for n in names]
            if len(names) == count and all(each == 2 for each in found):
                return
            if fleet.poll() is not None:
                raise SystemExit(f"the stand-in hosts exited with {fleet.returncode}")
            if time.monotonic() > deadline:
                raise SystemExit(f"{sum(f == 2 for f in found)} of {count} hosts came up")
            time.sleep(0.2)

    def settle(self, seconds: float = 3.0) -> None:
        """Let the scheduler read every declaration and quiet down."""
        time.sleep(seconds)

    def at_rest(self, seconds: float) -> dict[str, float]:
        before = self._redis_counters()
        services = {name: cpu_s(pids) for name, pids in self.pids.items()}
        began, wall = time.monotonic(), time.time()
        time.sleep(seconds)
        took = time.monotonic() - began
        after = self._redis_counters()
        times = self._plan_times()
        deadline = time.monotonic() + WRITE_EVERY_S + 1
        while (times is None or times.at < wall) and time.monotonic() < deadline:
            time.sleep(0.2)  # the leader writes its times every WRITE_EVERY_S
            times = self._plan_times()
        return {
            "redis_ops": (after["ops"] - before["ops"]) / took,
            "redis_cpu": (after["cpu"] - before["cpu"]) / took * 100,
            "redis_mib": after["bytes"] / 2**20,
            "scheduler_cpu": (cpu_s(self.pids["scheduler"]) - services["scheduler"]) / took * 100,
            "router_cpu": (cpu_s(self.pids["router"]) - services["router"]) / took * 100,
            "router_mib": rss_mib(self.pids["router"]),
            "tick_p50_ms": times.p50_ms if times else float("nan"),
            "tick_p99_ms": times.p99_ms if times else float("nan"),
            "tick_cpu_ms": times.cpu_ms if times else float("nan"),
        }

    def _redis_counters(self) -> dict[str, float]:
        stats = self.redis.info("stats")
        cpu = self.redis.info("cpu")
        memory = self.redis.info("memory")
        return {
            "ops": float(stats["total_commands_processed"]),
            "cpu": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
            "bytes": float(memory["used_memory"]),
        }

    def _plan_times(self) -> PlanTimes | None:
        raw = self.redis.get(keys.scheduler_plan_times())
        return None if raw is None else PlanTimes.model_validate_json(cast(bytes, raw))

    def listing(self, server: ingressstand.Role, count: int = 20) -> dict[str, float]:
        """`list deployments` and the status page, timed."""
        with Management(StatePaths(server.state)) as api:
            listed = [_timed(api.http, "/deployments") for _ in range(count)]
            base = str(api.http.base_url)
            page_url = base[: base.index(wire.PREFIX)] + "/"
            pages = [_timed(api.http, page_url) for _ in range(max(3, count // 4))]
        return {
            "list_p50_ms": statistics.median(ms for ms, _ in listed),
            "list_p99_ms": max(ms for ms, _ in listed),
            "list_kib": listed[-1][1] / 1024,
            "page_p50_ms": statistics.median(ms for ms, _ in pages),
            "page_kib": pages[-1][1] / 1024,
        }

    def propagation(self, server: ingressstand.Role, count: int) -> dict[str, float]:
        """How long a new deployment takes to be listed by the router, after its
        declaration was answered."""
        took = []
        headers = {"Authorization": f"Bearer {server.api_key()}"}
        with (
            Management(StatePaths(server.state)) as api,
            httpx.Client(base_url=f"http://127.0.0.1:{server.port}", headers=headers) as router,
        ):
            for index in range(count):
                name = f"probe{index}"
                api.deploy({"name": name, "engine": "vllm", "model": "m0"})
                began = time.perf_counter()
                while name not in router.get("/v1/models").text:
                    time.sleep(0.005)
                took.append((time.perf_counter() - began) * 1000)
        return {"listed_p50_ms": statistics.median(took), "listed_max_ms": max(took)}


def _timed(http: httpx.Client, url: str) -> tuple[float, int]:
    began = time.perf_counter()
    answer = http.get(url)
    answer.raise_for_status()
    return (time.perf_counter() - began) * 1000, len(answer.content)
