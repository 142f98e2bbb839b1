"""A server with two joined hosts, `ha` and `hb`, where `ha` turns hostile: what the
hostile-host suites (tests/chaos/test_hostile_*.py) share. `s1` is pinned to `hb` and
serving; `ha` holds a TCP listener of its own, to count what reaches it."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from capycommon.domain.hosts import Heartbeat
from capycommon.domain.instances import InstanceRecord
from capycommon.state import keys
from capyctl_cli.gpucheck.role import end_left_under
from enginerun import sparse_model
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine
from ports import free_port
from serversetup import ServerSetup, ask
from support import Role, capyctl, clean_env, join_host, short_dir, start_host, start_role

GiB = 1 << 30
SMALL = {"memory": {"request": "4GiB"}}
HOSTS = {"ha": "127.0.0.4", "hb": "127.0.0.5"}
SERVICES = ("router", "scheduler")
HOST_SERVICES = ("hostd", "memwatch")


def redis_as_host(state: Path) -> redis.Redis:
    """The server's Redis as the host of `state` dials it: its certificate, its user and
    password; one try per command, so a refusal is seen at once."""
    identity = state / "identity"
    joined = json.loads((identity / "joined.json").read_text())
    address, port = joined["redis_address"].rsplit(":", 1)
    return redis.Redis(
        host=address,
        port=int(port),
        ssl=True,
        ssl_certfile=str(identity / "host.pem"),
        ssl_ca_certs=str(identity / "server-ca.pem"),
        ssl_cert_reqs="required",
        username=joined["redis_user"],
        password=joined["redis_password"],
        protocol=2,
        retry=Retry(NoBackoff(), 0),
        socket_timeout=10,
    )


@dataclass
class Listener:
    """A TCP listener `ha` controls, counting the connections it is sent."""

    sock: socket.socket
    accepted: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"{host}:{port}"

    def serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                connection, _ = self.sock.accept()
                self.accepted += 1
                connection.close()


@dataclass
class Hostile(ServerSetup):
    hosts: dict[str, Role] = field(default_factory=dict)
    listener: Listener | None = None
    tried: int = 0

    def as_host(self, host: str) -> redis.Redis:
        """The server's Redis as `host`'s user, with its certificate and password."""
        return redis_as_host(self.folder / host / "state")

    def s1(self) -> InstanceRecord:
        raw = cast(bytes, self.redis.get(keys.instance("hb", "s1", 0)))
        return InstanceRecord.model_validate_json(raw)

    def placed(self) -> str | None:
        raw = cast(bytes, self.redis.get(keys.deployment("s1")))
        found: str | None = json.loads(raw).get("host")
        return found

    def beats(self) -> dict[str, tuple[int, float]]:
        """Each service's pid and start, from its heartbeat: the control plane's, and hb's
        (ha's own heartbeats are among what ha overwrites)."""
        named = {f"{s}": keys.heartbeat(s, "") for s in SERVICES}
        named |= {f"{s}@hb": keys.heartbeat(s, "hb") for s in HOST_SERVICES}
        found = {}
        for name, key in named.items():
            raw = cast(bytes | None, self.redis.get(key))
            if raw is not None:
                with contextlib.suppress(ValueError):
                    beat = Heartbeat.model_validate_json(raw)
                    found[name] = (beat.pid, beat.started_at)
        return found


@contextlib.contextmanager
def hostile_cluster() -> Iterator[Hostile]:
    """A server with hosts ha and hb started, and s1 pinned to hb and serving."""
    folder = short_dir("hostile")
    server = start_role("server", env=clean_env(HOME=str(folder)))
    found = Hostile(folder, server)
    fast = Behaviour(load_seconds=0.2, tokens_per_second=400)
    engine = install_python_engine(folder / "e" / "vllm", "vllm", "0.29.0", fast)
    sock = socket.socket()
    sock.bind((HOSTS["ha"], 0))  # the port is ha's own, reserved for the whole test
    sock.listen(64)
    found.listener = Listener(sock)
    serving = threading.Thread(target=found.listener.serve, daemon=True)
    serving.start()
    try:
        for name, address in HOSTS.items():
            home = folder / name
            state = home / "state"
            home.mkdir(parents=True)
            join_host(server, name, state)
            added = capyctl(
                "engine", "add", str(engine), "--name", "vllm", "--state-dir", str(state),
                env=clean_env(HOME=str(home)),
            )  # fmt: skip
            assert added.returncode == 0, added.stderr
            sparse_model(home / "models" / "small", 2 * GiB)
            found.hosts[name] = start_host(
                state,
                engine_range=3 if name == "ha" else 4,
                env={"HOME": str(home), "CAPYCTL_HOST_INGRESS_BIND": f"{address}:{free_port()}"},
            )
        found.deploy("s1", model="small", engine_config=SMALL, placement={"hosts": ["hb"]})
        ask(found.openai(timeout=180), "s1")  # the first starts its engine
        yield found
    finally:
        found.listener.stop.set()
        serving.join(timeout=5)
        sock.close()
        found.close_clients()
        for role in found.hosts.values():
            role.stop()
        server.stop()
        end_left_under(folder)  # engines outlive their roles by design: the test's own end here
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(server.state_dir.parent, ignore_errors=True)


def forged_record(values: dict[str, Any]) -> bytes:
    record = {
        "deployment": "s1",
        "instance": 0,
        "revision": 1,
        "generation": 1,
        "state": "ready",
        "since": time.time(),
        "host": "ha",
        "port": 8100,
        "family": "vllm",
        "served_name": "s1",
    }
    return json.dumps(record | values).encode()


def refused_by_metrics(hostile: Hostile) -> int:
    key = hostile.server.credentials()["api_key"]
    text = httpx.get(
        f"http://{hostile.server.inference}/metrics",
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    ).text
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith('capyctl_host_records_refused_total{host="ha"')
    )
