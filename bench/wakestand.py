"""The wake benchmark's stand: a standalone role on a simulated GPU with the engine simulator as
vLLM and two deployments that do not both fit ready, and the engine's own calls timed directly
(its wake, its park, its first token), the baselines `bench/wake.py` sets beside what CapyCTL
adds."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import redis
import yaml

import benchrole
from benchrole import GiB
from capycommon import procfs, simgpu
from capycommon.state import keys
from enginesim.behaviour import Behaviour

HOST = "local"
# Short engine calls, so what CapyCTL adds is visible beside them; fast tokens, so the first
# token is the engine's work of one token, not the answer's length.
BEHAVIOUR = Behaviour(
    load_seconds=0.5,
    sleep_seconds=0.25,
    wake_seconds=0.25,
    tokens_per_second=1000,
)
# How late the simulated device shows a park's memory released after the park call returned.
# vLLM frees it within its /sleep call (its worker reads the freed bytes from the driver before
# it returns), so its device shows the release a little late at most; SGLang's
# /release_memory_occupation can return before the memory is freed (`--late-release-ms 100`).
LATE_RELEASE_MS = 20
# 14 GiB charged on the card each (12.75 GiB asked, 1.25 GiB CUDA context): two never fit on
# a 24 GiB GPU, so a request for the parked one is a switch.
MEMORY = {"request": "13056MiB", "startup": "14GiB"}
ONE_TOKEN = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True}
# What hostd's vLLM adapter calls to wake a host_backed engine, and to park it.
WAKE_CALLS: tuple[tuple[str, dict[str, str]], ...] = (
    ("/wake_up", {"tags": "weights"}),
    ("/wake_up", {"tags": "kv_cache"}),
    ("/reset_prefix_cache", {}),
)
PARK_CALL = ("/sleep", {"level": "1"})
HEALTH_POLL_S = 0.002
# What the scheduler charges a parked model on its card (hostd's park counts within it).
PARKED_CHARGE = GiB


def until(check: Callable[[], Any], what: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)
    return found


# The deployments of a stand, by name: what each document adds to its engine and residency.
PAIR: dict[str, dict[str, Any]] = {
    name: {"model": "m10", "engine_config": {"memory": MEMORY}} for name in ("a", "b")
}
# A model across both GPUs of a two-GPU stand (each rank charged as `a` is), and `a` on gpu0.
SPAN: dict[str, dict[str, Any]] = {
    "big": {"model": "m20", "engine_config": {"tensor_parallel": 2, "memory": MEMORY}},
    "a": {"model": "m10", "devices": [{"id": "gpu0"}], "engine_config": {"memory": MEMORY}},
}


class Stand:
    """A standalone role with deployments of the simulated vLLM: `a` and `b` on one GPU, or
    the `documents` given on the simulated `gpus`."""

    def __init__(
        self,
        root: Path,
        behaviour: Behaviour,
        gpus: str = "gpu0:24GiB",
        documents: dict[str, dict[str, Any]] = PAIR,
    ) -> None:
        self.root = root
        self.state = root / "state"
        self.names = tuple(documents)
        self.env = benchrole.role_env(root)
        ports = random.randrange(20_000, 30_000, 10)
        # Ports of its own: other roles on this machine use the default range.
        document = benchrole.write_document(
            root, "256GiB", engine_ports=f"{ports}-{ports + 9}", simulated_gpus=gpus
        )
        benchrole.install_vllm(root, document.parent, "vllm", behaviour)
        benchrole.sparse_model(root / "models" / "m10", 10 * GiB)
        benchrole.sparse_model(root / "models" / "m20", 20 * GiB)
        self.inference = f"127.0.0.1:{benchrole.free_port()}"
        self.log = (root / "role.log").open("wb")
        self.role = benchrole.start_standalone(
            self.state, document, self.inference, self.log, self.env, HOST
        )
        self.redis = redis.Redis(unix_socket_path=str(self.state / "redis" / "redis.sock"))
        until(lambda: self.cli("list", "deployments").returncode == 0, "the role")
        for name, fields in documents.items():
            path = root / f"{name}.yaml"
            path.write_text(
                yaml.safe_dump(
                    {"name": name, "engine": "vllm", "residency": "host_backed", **fields}
                )
            )
            self.cli("deploy", "model", "--file", str(path), check=True)
        self.api_key = cast(
            dict[str, str], yaml.safe_load((self.state / "identity" / "credentials").read_text())
        )["api_key"]
        self.router = httpx.Client(
            base_url=f"http://{self.inference}/v1",
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=120,
        )

    def cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        return benchrole.cli(self.state, self.env, *args, check=check)

    def record(self, name: str) -> dict[str, Any] | None:
        raw = self.redis.get(keys.instance(HOST, name, 0))
        return None if raw is None else cast(dict[str, Any], json.loads(raw))

    def state_of(self, name: str) -> str | None:
        record = self.record(name)
        return None if record is None else str(record["state"])

    def engine(self, name: str) -> httpx.Client:
        """A client of the deployment's engine, directly, with its per-launch key."""
        record = self.record(name)
        assert record is not None
        assert record["port"] is not None
        secret = cast(bytes, self.redis.get(keys.instance_secret(HOST, name, 0))).decode()
        return httpx.Client(
            base_url=f"http://127.0.0.1:{record['port']}",
            headers={"Authorization": f"Bearer {secret}"},
            timeout=120,
        )

    def close(self) -> None:
        self.router.close()
        self.cli("drain", "standalone")
        until(
            lambda: all(self.state_of(n) in (None, "stopped", "failed") for n in self.names),
            "the engines to stop",
        )
        self.role.send_signal(signal.SIGTERM)
        self.role.wait(timeout=60)
        self.log.close()


# Timing -------------------------------------------------------------------------------------


def first_token(http: httpx.Client, path: str, body: dict[str, Any]) -> float:
    """Seconds from sending a streamed chat to its first event that carries text."""
    start = time.perf_counter()
    with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"{path} answered {response.status_code}: {response.read()!r}")
        lines = response.iter_lines()
        for line in lines:
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content") or delta.get("reasoning"):
                elapsed = time.perf_counter() - start
                for _ in lines:  # the rest of the stream, untimed
                    pass
                return elapsed
    raise SystemExit(f"{path}: the stream ended without a token")


def timed_calls(http: httpx.Client, calls: tuple[tuple[str, dict[str, str]], ...]) -> float:
    start = time.perf_counter()
    for path, params in calls:
        response = http.post(path, params=params)
        if response.status_code != 200:
            raise SystemExit(f"{path} answered {response.status_code}: {response.text}")
    return time.perf_counter() - start


@dataclass
class Engine:
    """What the engine's own calls took, timed directly against it."""

    park_s: float = 0.0
    wake_s: float = 0.0
    token_s: float = 0.0
    # From the park call's return until the simulated device shows the engine's memory within
    # its parked charge (it shows a release late, as NVML does): a park counts only then.
    release_s: float = 0.0


def engine_wake(stand: Stand, name: str) -> Engine:
    """The engine's own wake and first token, then its park: back asleep as hostd left it."""
    with stand.engine(name) as http:
        wake_s = timed_calls(http, WAKE_CALLS)
        token_s = first_token(http, "/v1/chat/completions", {"model": name, **ONE_TOKEN})
        park_s = timed_calls(http, (PARK_CALL,))
    return Engine(park_s=park_s, wake_s=wake_s, token_s=token_s)


def engine_park_wake(stand: Stand, name: str) -> Engine:
    """The ready engine's own park (and when its device shows the memory released), then its
    wake and first token: ready again, as it was."""
    with stand.engine(name) as http:
        park_s = timed_calls(http, (PARK_CALL,))
        release_s = _released_after(stand, name)
        wake_s = timed_calls(http, WAKE_CALLS)
        token_s = first_token(http, "/v1/chat/completions", {"model": name, **ONE_TOKEN})
    return Engine(park_s=park_s, wake_s=wake_s, token_s=token_s, release_s=release_s)


def _released_after(stand: Stand, name: str) -> float:
    """Seconds until the engine's process group holds at most its parked charge on each
    simulated GPU (its claim files, read every HEALTH_POLL_S; a rank on each GPU of a model
    across several)."""
    record = stand.record(name)
    assert record is not None
    assert record["process"] is not None
    pgid = int(record["process"]["pgid"])
    start = time.perf_counter()
    while True:
        members = set(procfs.group_members([pgid])[pgid])
        held = max(
            (
                sum(claim.bytes for pid, claim in usage.by_pid.items() if pid in members)
                for usage in simgpu.usage(stand.state / "simgpu").values()
            ),
            default=0,
        )
        if held <= PARKED_CHARGE:
            return time.perf_counter() - start
        if time.perf_counter() - start > 10:
            raise SystemExit(f"{name}'s engine still holds {held} bytes 10 s after its park")
        time.sleep(HEALTH_POLL_S)


def through_router(stand: Stand, name: str) -> tuple[float, float]:
    """(when the request was sent, wall clock; seconds to its first token)."""
    sent = time.time()
    return sent, first_token(stand.router, "/chat/completions", {"model": name, **ONE_TOKEN})


# Where the time went -------------------------------------------------------------------------
