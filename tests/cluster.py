"""A standalone role on simulated GPUs with the engine simulator's installs registered, and
the CLI, Redis and engine views the end-to-end tests use."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import openai
import redis
import redis.asyncio as aioredis
import yaml

from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.instances import Event, InstanceRecord
from capycommon.domain.places import Places
from capycommon.engines import registry
from capycommon.errors import CapyError, NotFound
from capycommon.paths import StatePaths
from capycommon.state import keys
from capycommon.state.stores import Blocking
from capyctl_cli.gpucheck.role import end_left_under
from capyctl_cli.management import Management
from capyctl_cli.management import wait_for as wait_until
from enginerun import sparse_model
from enginesim.behaviour import Behaviour, CrashAtStart, Faults, ToolCall
from enginesim.install import install_llama_server, install_python_engine
from runshared import shared_folder
from support import (
    Role,
    capyctl,
    clean_env,
    short_dir,
    start_role,
    wait_for,
)

if TYPE_CHECKING:
    from mockhub import MockHub

GiB = 1 << 30
HOST = "local"
# The role's settings, in the cluster's folder.
DOCUMENT = "standalone.yaml"
# Every model here is charged 14 GiB on its card: a 12.75 GiB request and 1.25 GiB of CUDA
# context; two never fit on one 24 GiB GPU (22.1 GiB managed), so each start is a switch.
FOURTEEN = {"memory": {"request": "13056MiB", "startup": "14GiB"}}
SMALL = {"memory": {"request": "4GiB"}}
_RUNNING = re.compile(
    r"^(?:vllm:num_requests_running|sglang:num_running_reqs)\{[^}]*\} (\S+)$", re.M
)
_GENERATED = re.compile(r"^(?:vllm|sglang):generation_tokens_total\{[^}]*\} (\S+)$", re.M)
_ABORTED = re.compile(r"^sglang:num_aborted_requests(?:_total)?\{[^}]*\} (\S+)$", re.M)


@dataclass
class Cluster:
    """One standalone role and the engines and models it serves."""

    role: Role
    root: Path
    clients: list[openai.OpenAI] = field(default_factory=list)  # closed by `clean`
    # The role's state, through the state layer's stores; closed by `close`.
    blocking: Blocking = field(init=False)

    def __post_init__(self) -> None:
        socket = self.role.state_dir / "redis" / "redis.sock"
        self.blocking = Blocking(aioredis.Redis(unix_socket_path=str(socket)))

    def close(self) -> None:
        """Close the cluster's own client of the role's Redis (the role runs on)."""
        self.blocking.close()

    def openai(self, timeout: float = 120) -> openai.OpenAI:
        """An openai SDK client of the role's endpoint, closed when the cluster is."""
        client = openai.OpenAI(
            base_url=self.base_url, api_key=self.api_key, timeout=timeout, max_retries=0
        )
        self.clients.append(client)
        return client

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return capyctl(
            *args, "--state-dir", str(self.role.state_dir), env=self.role.env, timeout=timeout
        )

    def ok(self, *args: str, timeout: float = 120) -> str:
        result = self.cli(*args, timeout=timeout)
        assert result.returncode == 0, f"capyctl {' '.join(args)}: {result.stderr}"
        return result.stdout

    # The management API through the CLI's own client, in this process: what `capyctl deploy
    # model`, `start deployment --wait` and `status deployment --json` send and read, for the
    # tests whose subject is not the command line (a capyctl process costs about a second of
    # CPU; the CLI's commands have tests of their own).

    def api(self) -> Management:
        return Management(StatePaths(self.role.state_dir))

    def deploy(self, name: str, **fields: Any) -> None:
        """Declare a deployment from `<root>/<name>.yaml` (written here): a Hub branch or tag
        through `capyctl deploy model`, which pins it to a commit; anything else as that
        command sends it."""
        document = {"name": name, "engine": "vllm", "model": "m14", **fields}
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(document))
        source = document["model"]
        if isinstance(source, dict) and "hf" in source and "@" not in source["hf"]:
            self.ok("deploy", "model", "--file", str(path))
            return
        with self.api() as api:
            api.deploy(document)

    def start(self, name: str, timeout: float = 120) -> None:
        """Start (or wake) the deployment and wait until it is ready."""
        with self.api() as api:
            since = time.time()
            api.act(name, "start")
            wait_until(api, name, lambda status: status.state == "ready", timeout, "ready", since)

    def status(self, name: str) -> dict[str, Any]:
        with self.api() as api:
            return api.status(name).model_dump(mode="json")

    @property
    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.role.state_dir / "redis" / "redis.sock"))

    def instance(self, name: str) -> InstanceRecord | None:
        raw = cast(bytes | None, self.client.get(keys.instance(HOST, name, 0)))
        return None if raw is None else InstanceRecord.model_validate_json(raw)

    def state(self, name: str) -> str | None:
        found = self.instance(name)
        return None if found is None else str(found.state)

    def events(self, name: str) -> list[Event]:
        """hostd's events of a deployment's instance, oldest first."""
        entries = cast(
            list[tuple[bytes, dict[bytes, bytes]]], self.client.xrange(keys.host_events(HOST))
        )
        found = (Event.model_validate_json(fields[b"event"]) for _, fields in entries)
        return [event for event in found if event.deployment == name]

    def choices(self, name: str) -> list[dict[str, Any]]:
        """The scheduler's choices about a deployment, oldest first."""
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], self.client.xrange(keys.events()))
        found = (json.loads(fields[b"event"]) for _, fields in entries)
        return [choice for choice in found if choice["deployment"] == name]

    def transitions(self, name: str) -> list[tuple[str | None, str | None, str]]:
        return [
            (e.from_state, e.to_state, e.reason)
            for e in self.events(name)
            if e.kind == "transition"
        ]

    def declared(self) -> dict[str, DeploymentRecord]:
        """The declared deployments, by name."""
        return self.blocking(lambda s: s.deployments.all())

    def places(self, name: str) -> Places:
        """The deployment's places, over every router worker."""
        return self.blocking(lambda s: s.places.get(name))

    def demand(self, name: str) -> None:
        """A demand as a router sends it."""
        self.blocking(lambda s: s.demands.ask(name, "test"))

    def engine(self, name: str) -> tuple[str, str]:
        """The engine's base URL and per-launch key (to compare with, or watch, the engine)."""
        instance = self.instance(name)
        assert instance is not None
        assert instance.port is not None
        secret = cast(bytes, self.client.get(keys.instance_secret(HOST, name, 0))).decode()
        return f"http://127.0.0.1:{instance.port}", secret

    def engine_metrics(self, name: str) -> str:
        url, secret = self.engine(name)
        headers = {"Authorization": f"Bearer {secret}"}
        return httpx.get(f"{url}/metrics", headers=headers, timeout=5).text

    def engine_running(self, name: str) -> int:
        found = _RUNNING.search(self.engine_metrics(name))
        assert found is not None, "the engine reports its running requests"
        return int(float(found[1]))

    def engine_generated(self, name: str) -> int:
        """The tokens the engine has generated since it started, as its metrics count them."""
        found = _GENERATED.search(self.engine_metrics(name))
        assert found is not None, "the engine reports its generated tokens"
        return int(float(found[1]))

    def engine_aborted(self, name: str) -> int:
        found = _ABORTED.search(self.engine_metrics(name))
        return int(float(found[1])) if found else 0

    @property
    def api_key(self) -> str:
        return self.role.credentials()["api_key"]

    @property
    def base_url(self) -> str:
        return f"http://{self.role.inference}/v1"

    def start_again(self) -> None:
        """Start the role again once it stopped (its engines ran on), on the same state dir,
        settings and listeners, as an operator's restart does."""
        self.role = start_role(
            "standalone",
            state_dir=self.role.state_dir,
            env=self.role.env,
            extra=["--config", str(self.root / DOCUMENT)],
            listeners=(self.role.inference, self.role.management),
        )

    def clean(self) -> None:
        """Delete every deployment at once, through the management API's client, and wait
        until each is gone (its engine stopped), as `delete deployment --wait` does."""
        for client in self.clients:
            client.close()
        names = self.declared()
        if not names:
            return
        with self.api() as api:
            for name in names:
                try:
                    api.act(name, "delete")
                except CapyError as exc:
                    # A deployment a test deleted may finish going between the read and here.
                    if exc.code != NotFound.code:
                        raise
            try:
                wait_for(
                    lambda: not api.deployments(),
                    timeout=120,
                    what="every deployment deleted",
                    interval=0.25,
                )
            except AssertionError as exc:
                raise AssertionError(f"{exc}; left: {self._left(api)}") from None

    def _left(self, api: Management) -> str:
        """The deployments left, each with its instance, places and last choices: what a
        delete that did not end waits for."""
        found = []
        for status in api.deployments():
            name = status.name
            instance = self.instance(name)
            state = None if instance is None else (instance.state, instance.generation)
            held = self.places(name)
            choices = [d.get("reason") for d in self.choices(name)[-4:]]
            found.append(f"{name}: instance {state}, {held!r}, choices {choices}")
        logs = self.role.state_dir / "logs"
        for service in ("scheduler", "hostd"):
            path = logs / f"{service}.log"
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            found.append(f"the end of {service}.log:\n" + "\n".join(lines[-15:]))
        return "; ".join(found)


def install_engines(root: Path) -> None:
    """Register the simulated engines for a role whose HOME is `root`: a copy of the registry
    of this test process's installs (`capyctl engine add` run once for them all)."""
    target = registry.locate(None, root)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copy(_shared_engines(), target)


@functools.cache
def _shared_engines() -> Path:
    """The simulated engines, installed and registered with `capyctl engine add` once per
    run, in a folder its test processes share; the registry's path.

    Each cluster of the run registers these same installs: making a venv with pip and adding
    it cost about 2.5 s of CPU per engine, for each of a dozen clusters, and none is ever
    changed (a test that needs another behaviour installs an engine of its own)."""
    return registry.locate(None, shared_folder("capy-engines", _install_engines))


def _install_engines(root: Path) -> None:
    state, env = root / "state", clean_env(HOME=str(root))
    fast = Behaviour(load_seconds=0.5, tokens_per_second=200)
    installs = {
        "vllm": install_python_engine(root / "e" / "vllm", "vllm", "0.29.0", fast),
        "sglang": install_python_engine(root / "e" / "sglang", "sglang", "0.5.16", fast),
        "slow": install_python_engine(
            root / "e" / "slow",
            "vllm",
            "0.29.0",
            Behaviour(load_seconds=0.5, tokens_per_second=8, answer=" ".join(["word"] * 80)),
        ),
        "leaky": install_python_engine(
            root / "e" / "leaky",
            "vllm",
            "0.29.0",
            Behaviour(load_seconds=0.5, faults=Faults(sleep_keeps_memory=True)),
        ),
        "crashy": install_python_engine(
            root / "e" / "crashy",
            "vllm",
            "0.29.0",
            Behaviour(load_seconds=0.5, faults=Faults(crash_at_start=CrashAtStart())),
        ),
        "slowload": install_python_engine(
            root / "e" / "slowload", "vllm", "0.29.0", Behaviour(load_seconds=60)
        ),
        "tools": install_python_engine(
            root / "e" / "tools",
            "vllm",
            "0.29.0",
            Behaviour(
                load_seconds=0.5,
                tokens_per_second=200,
                tool_call=ToolCall(name="get_weather", arguments={"city": "Paris"}),
            ),
        ),
        "prefill": install_python_engine(
            root / "e" / "prefill", "vllm", "0.29.0", Behaviour(load_seconds=0.5, prefill_seconds=5)
        ),
        "slowsglang": install_python_engine(
            root / "e" / "slowsglang",
            "sglang",
            "0.5.16",
            Behaviour(load_seconds=0.5, tokens_per_second=8, answer=" ".join(["word"] * 80)),
        ),
        # Takes 6 GiB more than its ready footprint while it loads, as real engines do.
        "peaky": install_python_engine(
            root / "e" / "peaky",
            "vllm",
            "0.29.0",
            Behaviour(load_seconds=1.5, tokens_per_second=200, startup_extra_bytes=6 * GiB),
        ),
        "llama": install_llama_server(root / "e" / "llama", 6000, fast).parent,
    }
    for name, path in installs.items():
        target = path / "llama-server" if name == "llama" else path
        result = capyctl(
            "engine", "add", str(target), "--name", name, "--state-dir", str(state), env=env
        )
        assert result.returncode == 0, result.stderr


def start_cluster(
    root: Path,
    gpus: str,
    scheduling: dict[str, Any] | None = None,
    routing: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> Cluster:
    state = root / "state"
    env = clean_env(
        HOME=str(root),
        CAPYCTL_SIMULATED_GPUS=gpus,
        CAPYCTL_SIMULATED_HOST_RAM="256GiB",
        **(env or {}),
    )
    install_engines(root)
    for name, size in (("m14", 10 * GiB), ("small", 2 * GiB), ("six", 6 * GiB), ("huge", 40 * GiB)):
        sparse_model(root / "models" / name, size)
    sparse_model(root / "models" / "gguf", 1 * GiB, gguf=True)
    document = root / DOCUMENT
    document.write_text(
        yaml.safe_dump(
            {
                "kind": "standalone",
                "server": {
                    "scheduling": scheduling or {"drain_timeout": 10, "park_verify_timeout": 3},
                    "routing": routing or {},
                    # Two workers whatever the machine's CPUs: requests share places
                    # across workers, as on any machine of 8 CPUs or more.
                    "router": {"workers": 2},
                },
            }
        )
    )
    role = start_role("standalone", state_dir=state, env=env, extra=["--config", str(document)])
    return Cluster(role, root)


@contextmanager
def running(prefix: str, gpus: str = "gpu0:24GiB", **settings: Any) -> Iterator[Cluster]:
    """A cluster for the length of a `with`; its engines are stopped before the role (they
    outlive their role by design) and its folder is removed."""
    root = short_dir(prefix)
    cluster = start_cluster(root, gpus, **settings)
    try:
        yield cluster
    finally:
        try:
            cluster.clean()
        finally:  # a role is never left behind, even when its engines could not be deleted
            cluster.close()
            cluster.role.stop()
            end_left_under(root)  # engines or LMCache servers a failed delete left
            shutil.rmtree(root, ignore_errors=True)


def on_hub(prefix: str, hub: MockHub, gpus: str = "gpu0:24GiB") -> Iterator[Cluster]:
    """For a module's fixture to `yield from`: a cluster (as `running`) whose hostd downloads
    the models that deployments name by `model: {hf: ...}` from the mock `hub`."""
    with running(prefix, gpus, env={"CAPYCTL_HF_ENDPOINT": hub.url}) as found:
        yield found
