"""Running hostd as a real process against a real Redis, with simulated GPUs and engines."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import redis
import redis.asyncio as aioredis

from capycommon import simgpu
from capycommon.domain.commands import Abort, Launch, Park, Stop, Wake
from capycommon.domain.hosts import EngineLoad
from capycommon.domain.instances import InstanceRecord
from capycommon.engines import detect, registry
from capycommon.state import hostcommands, keys
from capycommon.state.stores import Blocking, State
from capyctl_hostd.ports import is_free
from enginesim.behaviour import Behaviour
from ports import engine_ports as port_range
from support import clean_env, group_members, service_command, wait_for

T = TypeVar("T")
HOST = "local"
GiB = 1 << 30
FAST = Behaviour(load_seconds=0.3, warmup_seconds=0.2, tokens_per_second=200)


@dataclass
class Hostd:
    state: Path
    home: Path
    redis_socket: Path
    # A range apart from a role's (0), so a role the test runs beside it takes no port
    # between a lease and the engine's bind; below the kernel's ephemeral ports.
    engine_ports: str = field(default_factory=lambda: port_range(10))
    # More of hostd's settings, as variables.
    settings: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    memwatch: subprocess.Popen[bytes] | None = None

    @property
    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.redis_socket))

    def read(self, call: Callable[[State], Coroutine[Any, Any, T]]) -> T:
        """One call of the state layer, over a client of its own."""
        with Blocking(aioredis.Redis(unix_socket_path=str(self.redis_socket))) as blocking:
            return blocking(call)

    @property
    def simgpu_dir(self) -> Path:
        return self.state / "simgpu"

    @property
    def log(self) -> Path:
        return self.state / "hostd.out"

    def prepare(self, installs: dict[str, Path]) -> str:
        """Simulated GPU gpu0 (24 GiB), the engines registered; returns the GPU's UUID."""
        (device,) = simgpu.parse_devices("gpu0:24GiB")
        simgpu.write_devices(self.simgpu_dir, [device])
        file = registry.locate(None, self.home)
        for name, path in installs.items():
            (found,) = detect.probe(path)
            registry.add(file, found.profile(name))
        return device.uuid

    def start(self) -> None:
        env = clean_env(
            HOME=str(self.home),
            CAPYCTL_REDIS_URL=f"unix://{self.redis_socket}",
            CAPYCTL_SIMULATED_GPUS="gpu0:24GiB",
            CAPYCTL_ENGINE_PORTS=self.engine_ports,
            CAPYCTL_LOG_FORMAT="json",
            CAPYCTL_HOST_NAME=HOST,
            **self.settings,
        )
        self.proc = self._spawn("hostd", env, self.log)
        wait_for(
            lambda: self.client.exists(keys.heartbeat("hostd", HOST)), timeout=60, what="hostd"
        )

    def start_memwatch(self) -> None:
        """memwatch on the same state folder: it reads the claims of hostd's engines."""
        env = clean_env(
            CAPYCTL_REDIS_URL=f"unix://{self.redis_socket}",
            CAPYCTL_SIMULATED_GPUS="gpu0:24GiB",
            CAPYCTL_SIMULATED_HOST_RAM="64GiB",
            CAPYCTL_HOST_NAME=HOST,
        )
        self.memwatch = self._spawn("memwatch", env, self.state / "memwatch.out")
        wait_for(
            lambda: self.read(lambda s: s.memory.reading(HOST)),
            timeout=15,
            what="memwatch's reading",
        )

    def _spawn(self, service: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """The service on this state folder, its output added to `log` (a restart's after
        the last run's)."""
        with log.open("ab") as out:
            return subprocess.Popen(
                service_command(service, self.state), env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.client.delete(keys.heartbeat("hostd", HOST))

    def stop(self) -> None:
        for proc in (self.proc, self.memwatch):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=20)

    def send(self, command: Launch | Park | Wake | Stop | Abort, epoch: int | None = None) -> None:
        """Send a command as a scheduler does, with the epoch of its lease if it holds one."""
        self.client.xadd(keys.host_commands(HOST), hostcommands.fields_of(command, epoch))

    def record(self, deployment: str, index: int = 0) -> InstanceRecord | None:
        raw = cast(bytes | None, self.client.get(keys.instance(HOST, deployment, index)))
        return None if raw is None else InstanceRecord.model_validate_json(raw)

    def wait_state(self, deployment: str, state: str, timeout: float = 30) -> InstanceRecord:
        def reached() -> InstanceRecord | None:
            record = self.record(deployment)
            return record if record is not None and record.state == state else None

        try:
            return wait_for(reached, timeout=timeout, what=f"{deployment} to be {state}")
        except AssertionError:
            raise AssertionError(
                f"{deployment} is {self.record(deployment)}; hostd said:\n{self.log.read_text()}"
            ) from None

    def secret(self, deployment: str) -> str:
        raw = cast(bytes, self.client.get(keys.instance_secret(HOST, deployment, 0)))
        return raw.decode()

    def secret_or_none(self, deployment: str) -> bytes | None:
        return cast(bytes | None, self.client.get(keys.instance_secret(HOST, deployment, 0)))

    def loads(self) -> dict[str, EngineLoad]:
        return self.read(lambda s: s.loads.get(HOST))

    def events(self) -> list[dict[str, Any]]:
        entries = cast(
            list[tuple[bytes, dict[bytes, bytes]]], self.client.xrange(keys.host_events(HOST))
        )
        return [json.loads(fields[b"event"]) for _, fields in entries]

    def transitions(self) -> list[tuple[str | None, str]]:
        """Each state transition hostd recorded, (from, to), oldest first."""
        return [
            (e["from_state"], e["to_state"]) for e in self.events() if e["kind"] == "transition"
        ]

    def device_bytes(self, record: InstanceRecord) -> tuple[int, int]:
        """What the engine's process group claims on the simulated GPU."""
        assert record.process is not None
        usage = simgpu.usage(self.simgpu_dir).get(record.gpu_uuid or "")
        if usage is None:
            return (0, 0)
        mine = [c for pid, c in usage.by_pid.items() if pid in group_members(record.process.pgid)]
        return (sum(c.bytes for c in mine), sum(c.host_bytes for c in mine))


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = [item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


def launch(deployment: str, generation: int, gpu: str, model: Path, **changes: object) -> Launch:
    values: dict[str, object] = {
        "deployment": deployment,
        "generation": generation,
        "revision": 1,
        "profile": "vllm",
        "model_path": str(model),
        "served_name": deployment,
        "residency": "host_backed",
        "gpu_uuid": gpu,
        "memory_fraction": 0.25,
        "context_length": 4096,
        "start_deadline_s": 60,
    }
    values.update(changes)
    return Launch.model_validate(values)


def assert_group_gone(record: InstanceRecord) -> None:
    """The engine's whole process group has exited."""
    assert record.process is not None
    assert group_members(record.process.pgid) == []


def assert_torn_down(record: InstanceRecord) -> None:
    """The engine's whole process group has exited and its port is free again."""
    assert_group_gone(record)
    assert is_free(record.port or 0), "the port is free again"
