"""One role with an embedded host plus remote ones: a server that is also a host (as a
standalone role is) and two joined hosts on their own loopback addresses, each with a 24 GiB
simulated GPU, serve three 14 GiB models at once through one OpenAI endpoint. The embedded
host's engines are dialed on loopback, the joined hosts' through their ingresses. A
standalone role on the same machine serves beside them, apart.

The tests run in order on one server and its hosts: each leaves the next its setting.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import openai
import pytest

from capycommon.domain.hosts import HostInfo
from capycommon.domain.instances import LIVE_STATES, InstanceRecord, InstanceState
from capycommon.state import keys
from cluster import FOURTEEN, SMALL, GiB, running
from enginerun import sparse_model
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine
from ports import engine_ports, free_port
from serversetup import ServerSetup, ask
from support import (
    Role,
    capyctl,
    clean_env,
    join_with_engines,
    processes_mentioning,
    short_dir,
    start_host,
    start_role,
    wait_for,
)

EMBEDDED = "gpu-main"
JOINED = {"gpu-a": "127.0.0.2", "gpu-b": "127.0.0.3"}
HOSTS = (EMBEDDED, *JOINED)


@dataclass
class Setup(ServerSetup):
    hosts: dict[str, Role] = field(default_factory=dict)

    def live(self, name: str) -> InstanceRecord | None:
        """The deployment's live instance of the highest generation, on any host."""
        found = []
        for host in HOSTS:
            raw = cast(bytes | None, self.redis.get(keys.instance(host, name, 0)))
            if raw is not None:
                found.append(InstanceRecord.model_validate_json(raw))
        live = [i for i in found if i.state in LIVE_STATES]
        return max(live, key=lambda i: i.generation) if live else None

    def where(self, name: str) -> str | None:
        found = self.live(name)
        return None if found is None else found.host


def _models(home: Path) -> None:
    sparse_model(home / "models" / "m14", 10 * GiB)
    sparse_model(home / "models" / "small", 2 * GiB)


def _add_engine(engine: Path, state: Path, env: dict[str, str], *extra: str) -> None:
    """Register the simulated engine as `vllm` on the role of `state`."""
    added = capyctl(
        "engine", "add", str(engine), "--name", "vllm", *extra, "--state-dir", str(state), env=env
    )
    assert added.returncode == 0, added.stderr


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    folder = short_dir("mixed")
    main = folder / "main"
    fast = Behaviour(load_seconds=0.5, tokens_per_second=200)
    engine = install_python_engine(folder / "e" / "vllm", "vllm", "0.29.0", fast)
    state = main / "state"
    env = clean_env(
        HOME=str(main),
        CAPYCTL_SIMULATED_GPUS="gpu0:24GiB",
        CAPYCTL_SIMULATED_HOST_RAM="64GiB",
        CAPYCTL_MODELS_ROOT=str(main / "models"),
        CAPYCTL_ENGINE_PORTS=engine_ports(3),
    )
    main.mkdir(parents=True)
    _add_engine(engine, state, env, "--role", "server")
    _models(main)
    sparse_model(main / "models" / "only-main", 2 * GiB)
    server = start_role(
        "server", state, extra=("--embedded-host", "on", "--host-name", EMBEDDED), env=env
    )
    found = Setup(folder, server)
    try:
        for index, (name, address) in enumerate(JOINED.items()):
            home = folder / name
            host_state = join_with_engines(server, name, home, {"vllm": engine})
            _models(home)
            found.hosts[name] = start_host(
                host_state,
                engine_range=4 + index,
                env={"HOME": str(home), "CAPYCTL_HOST_INGRESS_BIND": f"{address}:{free_port()}"},
            )
        yield found
    finally:
        found.close_clients()
        for role in found.hosts.values():
            role.stop()
        server.stop()
        for pid in processes_mentioning(str(folder)):  # engines outlive their roles
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


def test_the_server_runs_its_own_host_beside_the_joined_ones(setup: Setup) -> None:
    names = set(setup.server.processes())
    assert {"redis", "router", "scheduler", "hostd", "memwatch"} <= names
    rows = json.loads(setup.ok("list", "hosts", "--json"))
    joined = {row["name"]: row["joined"] for row in rows}
    assert joined == {EMBEDDED: False, "gpu-a": True, "gpu-b": True}
    # The embedded host has no ingress: the router reaches its engines on loopback.
    raw = cast(bytes | None, setup.redis.get(keys.host_info(EMBEDDED)))
    assert raw is not None
    info = HostInfo.model_validate_json(raw)
    assert info.ingress is None
    refused = setup.server.capyctl("invite", "host", EMBEDDED, "--output", "-")
    assert refused.returncode != 0
    assert "embedded host" in refused.stderr, refused.stderr


def test_three_models_run_at_once_one_on_each_host(setup: Setup) -> None:
    for name in ("m1", "m2", "m3"):
        setup.deploy(name, engine_config=FOURTEEN)
    client = setup.openai()
    for name in ("m1", "m2", "m3"):
        assert ask(client, name), f"{name} answered nothing"
        assert ask(client, name, stream=True), f"{name} streamed nothing"
    # Two 14 GiB models never fit on one 24 GiB GPU: three at once need all three hosts.
    placed = {name: setup.live(name) for name in ("m1", "m2", "m3")}
    assert all(i is not None and i.state == InstanceState.READY for i in placed.values()), placed
    assert {i.host for i in placed.values() if i is not None} == set(HOSTS)
    for name in ("m1", "m2", "m3"):  # and each is served where it is, without a switch
        assert ask(client, name, stream=True)
    assert {name: setup.where(name) for name in placed} == {
        name: i.host for name, i in placed.items() if i is not None
    }


def test_a_model_only_the_embedded_host_has_runs_there(setup: Setup) -> None:
    setup.deploy("only", model="only-main", engine_config=SMALL)
    assert ask(setup.openai(), "only")
    assert setup.where("only") == EMBEDDED
    text = json.dumps(json.loads(setup.ok("status", "deployment", "only", "--json")))
    assert "gpu-a" in text, text
    assert "only-main" in text, text


def test_draining_the_embedded_host_moves_its_models_to_the_joined_hosts(setup: Setup) -> None:
    setup.deploy("roam", model="small", engine_config=SMALL, placement={"hosts": [EMBEDDED]})
    client = setup.openai()
    assert ask(client, "roam")
    assert setup.where("roam") == EMBEDDED
    # Unpinned, it stays where it runs; drained, the embedded host stops it and takes no new
    # model, so the next request starts it on a joined host.
    setup.deploy("roam", model="small", engine_config=SMALL)
    assert "takes no new model" in setup.ok("drain", "host", EMBEDDED)
    wait_for(lambda: setup.where("roam") is None, timeout=30, what="roam to stop")
    assert ask(client, "roam")
    assert setup.where("roam") in JOINED
    # The model only the embedded host has is refused while it is drained, and says why.
    wait_for(lambda: setup.where("only") is None, timeout=30, what="only to stop")
    with pytest.raises(openai.APIStatusError) as refused:
        ask(setup.openai(timeout=30), "only")
    assert refused.value.status_code == 503
    assert "drained" in str(refused.value.body), refused.value.body
    assert "takes models again" in setup.ok("undrain", "host", EMBEDDED)
    assert ask(client, "only")
    assert setup.where("only") == EMBEDDED


def test_a_standalone_role_beside_them_serves_on_its_own_and_takes_no_host(setup: Setup) -> None:
    with running("mixed-standalone") as standalone:
        standalone.deploy("solo", model="small", engine_config=SMALL)
        alone = standalone.openai()
        # Both answer at once, each from its own GPUs: neither sees the other's models.
        assert ask(alone, "solo")
        assert ask(setup.openai(), "m1")
        with pytest.raises(openai.NotFoundError):
            ask(alone, "m1")
        with pytest.raises(openai.NotFoundError):
            ask(setup.openai(), "solo")
        refused = standalone.cli("invite", "host", "gpu-c", "--output", str(standalone.root / "c"))
        assert refused.returncode != 0
        assert "--embedded-host on" in refused.stderr, refused.stderr
