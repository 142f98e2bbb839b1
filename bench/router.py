"""What the router adds: the same simulated engine through the router and directly, in one run.

Starts a standalone role on a simulated GPU with the engine simulator as vLLM, then prints:
- added latency per request (p50, p99) of a short non-streamed chat answer, router / direct;
- streamed-token throughput of a long answer, router / direct;
- the time from a request for a parked model to its first token, against the engine's own
  wake time (hostd's waking -> ready, which includes the wake canary);
- how N streamed requests sent at once from one client end (200, 429 queue_full; never a
  500), the time until the last ended, the Redis connections of the role at their peak, and
  the tracebacks in the role's logs (none). The role lets one client hold N connections.

    .venv/bin/python bench/router.py [--requests N] [--wakes N] [--streams N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

import httpx
import redis
import redis.asyncio as aioredis
import yaml

from capycommon.engines import detect, registry
from capycommon.state import keys
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine

GiB = 1 << 30
CAPYCTL = [sys.executable, "-m", "capyctl_cli"]
HI = [{"role": "user", "content": "hi"}]
# Fast enough that the engine is not what is measured: 50k tokens/s, a 2000-token answer.
BEHAVIOUR = Behaviour(
    load_seconds=0.5, wake_seconds=0.5, tokens_per_second=50_000, answer=" ".join(["tok"] * 2000)
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Stand:
    """A standalone role with one deployment, `bench`, of the simulated vLLM."""

    def __init__(self, root: Path, *flags: str) -> None:
        self.root = root
        self.state = root / "state"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
        self.env["HOME"] = str(root)
        config = self.state / "config"
        config.mkdir(parents=True)
        self.document = config / "standalone.yaml"
        self.document.write_text(
            yaml.safe_dump(
                {
                    "kind": "standalone",
                    "host": {
                        "simulated_gpus": "gpu0:24GiB",
                        "simulated_host_ram": "64GiB",
                        "models_root": str(root / "models"),
                    },
                }
            )
        )
        venv = install_python_engine(root / "vllm", "vllm", "0.29.0", BEHAVIOUR)
        (found,) = detect.probe(venv)
        registry.add(config / registry.FILE_NAME, found.profile("vllm"))
        model = root / "models" / "bench"
        model.mkdir(parents=True)
        with (model / "model.safetensors").open("wb") as weights:
            weights.truncate(2 * GiB)
        self.inference = f"127.0.0.1:{_free_port()}"
        self.log = (root / "role.log").open("wb")
        self.role = subprocess.Popen(
            [
                *CAPYCTL,
                "start",
                "standalone",
                "--state-dir",
                str(self.state),
                "--config",
                str(self.document),
                "--listen",
                self.inference,
                "--management-listen",
                f"127.0.0.1:{_free_port()}",
                "--host-name",
                "local",
                *flags,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        self.redis = redis.Redis(unix_socket_path=str(self.state / "redis" / "redis.sock"))
        deployment = root / "bench.yaml"
        deployment.write_text(
            "name: bench\nengine: vllm\nmodel: bench\nengine_config: {memory: {request: 6GiB}}\n"
        )
        self._until(lambda: self.cli("list", "deployments").returncode == 0, "the role")
        self.cli("deploy", "model", "--file", str(deployment), "--wait", check=True)
        self.api_key = cast(
            dict[str, str], yaml.safe_load((self.state / "identity" / "credentials").read_text())
        )["api_key"]

    def cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        found = subprocess.run(
            [*CAPYCTL, *args, "--state-dir", str(self.state)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if check and found.returncode:
            raise SystemExit(f"capyctl {' '.join(args)}: {found.stderr}")
        return found

    def engine(self) -> tuple[str, str]:
        raw = cast(bytes, self.redis.get(keys.instance("local", "bench", 0)))
        port = json.loads(raw)["port"]
        secret = cast(bytes, self.redis.get(keys.instance_secret("local", "bench", 0))).decode()
        return f"http://127.0.0.1:{port}/v1", secret

    def last_wake_s(self) -> float:
        entries = cast(
            list[tuple[bytes, dict[bytes, bytes]]],
            self.redis.xrevrange(keys.host_events("local"), count=50),
        )
        for _, fields in entries:
            event = json.loads(fields[b"event"])
            if (event.get("from_state"), event.get("to_state")) == ("waking", "ready"):
                return float(event["duration_s"])
        raise SystemExit("no wake in hostd's events")

    @staticmethod
    def _until(check: Any, what: str) -> None:
        deadline = time.monotonic() + 60
        while not check():
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}")
            time.sleep(0.2)

    def close(self) -> None:
        self.cli("drain", "standalone")
        self._until(
            lambda: (
                b'"stopped"' in (self.redis.get(keys.instance("local", "bench", 0)) or b'"stopped"')
            ),
            "the engine to stop",
        )
        self.role.send_signal(signal.SIGTERM)
        self.role.wait(timeout=60)
        self.log.close()


def _latencies(url: str, key: str, n: int) -> list[float]:
    body = {"model": "bench", "messages": HI, "max_tokens": 8}
    found = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        for i in range(n + 20):
            start = time.perf_counter()
            response = http.post("/chat/completions", json=body)
            elapsed = time.perf_counter() - start
            assert response.status_code == 200, response.text
            if i >= 20:  # warm-up
                found.append(elapsed)
    return found


def _throughput(url: str, key: str, rounds: int = 5) -> float:
    """Streamed tokens (SSE data events) per second over a long answer."""
    body = {"model": "bench", "messages": HI, "stream": True}
    best = 0.0
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120
    ) as http:
        for _ in range(rounds):
            start = time.perf_counter()
            tokens = 0
            with http.stream("POST", "/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        tokens += 1
            best = max(best, tokens / (time.perf_counter() - start))
    return best


def _first_token_after_park(stand: Stand, url: str) -> tuple[float, float]:
    stand.cli("park", "deployment", "bench", "--wait", check=True)
    body = {"model": "bench", "messages": HI, "stream": True, "max_tokens": 4}
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {stand.api_key}"}, timeout=120
    ) as http:
        start = time.perf_counter()
        with http.stream("POST", "/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break
            first = time.perf_counter() - start
    return first, stand.last_wake_s()


def _concurrent(stand: Stand, url: str, n: int) -> tuple[Counter[str], float, int]:
    """`n` streamed requests at once: how they ended, the seconds until the last did, and the
    most Redis connections seen meanwhile."""
    body = {"model": "bench", "messages": HI, "stream": True, "max_tokens": 16}
    headers = {"Authorization": f"Bearer {stand.api_key}"}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    peak = 0

    async def one(http: httpx.AsyncClient) -> str:
        try:
            async with http.stream("POST", "/chat/completions", json=body) as response:
                async for _ in response.aiter_bytes():
                    pass
                return str(response.status_code)
        except httpx.HTTPError as exc:
            return type(exc).__name__

    async def watch(client: aioredis.Redis) -> None:
        nonlocal peak
        while True:
            peak = max(peak, int((await client.info("clients"))["connected_clients"]) - 1)
            await asyncio.sleep(0.02)

    async def run() -> list[str]:
        socket_path = str(stand.state / "redis" / "redis.sock")
        async with (
            aioredis.Redis(unix_socket_path=socket_path) as client,
            httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=600) as http,
        ):
            watching = asyncio.create_task(watch(client))
            try:
                return await asyncio.gather(*(one(http) for _ in range(n)))
            finally:
                watching.cancel()

    start = time.perf_counter()
    ends = asyncio.run(run())
    return Counter(ends), time.perf_counter() - start, peak


def _tracebacks(stand: Stand) -> int:
    return sum(log.read_text().count("Traceback") for log in (stand.state / "logs").glob("*.log"))


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def main(requests: int, wakes: int, streams: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="capy-bench-"))
    stand = Stand(root, "--server-listeners-inference-connections-per-client", str(streams + 16))
    try:
        router_url = f"http://{stand.inference}/v1"
        engine_url, secret = stand.engine()
        direct = _latencies(engine_url, secret, requests)
        routed = _latencies(router_url, stand.api_key, requests)
        print(f"{'':<26}{'direct':>10}{'router':>10}{'ratio':>8}")
        for name, p in (("latency p50 (ms)", 0.5), ("latency p99 (ms)", 0.99)):
            a, b = _pct(direct, p) * 1000, _pct(routed, p) * 1000
            print(f"{name:<26}{a:>10.2f}{b:>10.2f}{b / a:>8.2f}")
        added = statistics.median(routed) - statistics.median(direct)
        print(f"{'added per request (ms)':<26}{'':>10}{added * 1000:>10.2f}")
        a, b = _throughput(engine_url, secret), _throughput(router_url, stand.api_key)
        print(f"{'streamed tokens/s':<26}{a:>10.0f}{b:>10.0f}{b / a:>8.2f}")
        for _ in range(wakes):
            first, wake = _first_token_after_park(stand, router_url)
            print(
                f"{'parked -> first token (s)':<26}{wake:>10.2f}{first:>10.2f}{first / wake:>8.2f}"
                "   (direct: hostd's waking -> ready)"
            )
        print(
            f"the simulator's own wake takes {BEHAVIOUR.wake_seconds:.2f} s; hostd's waking ->"
            " ready adds its readiness probe and the wake canary"
        )
        print(f"over {requests} requests each; the engine simulator as vLLM on a simulated GPU")
        if streams:
            ends, seconds, peak = _concurrent(stand, router_url, streams)
            shown = ", ".join(f"{end} x {count}" for end, count in sorted(ends.items()))
            print(f"{streams} streams at once: {shown} in {seconds:.1f} s")
            print(f"Redis connections at their peak (the role's services and this bench): {peak}")
            print(f"tracebacks in the role's logs: {_tracebacks(stand)}")
    finally:
        stand.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--wakes", type=int, default=3)
    parser.add_argument("--streams", type=int, default=1000)
    args = parser.parse_args()
    main(args.requests, args.wakes, args.streams)
