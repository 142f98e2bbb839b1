"""Three replicated servers' Redis and Sentinels as the server role configures them, on
127.0.0.11, .12 and .13 (one TLS port and one Sentinel port, the same on the three, as the
servers share them): the first server's state dir made as its first start makes it, the other
two from its peer file, each Redis and Sentinel started from the configuration the launcher
writes (asking the Sentinels which Redis is the primary), with the real authority's
certificates. `Server.kill` kills a server's Redis and Sentinel with SIGKILL, as its machine
lost; `Server.start` starts them again as the launcher would."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from capycommon import peerfile
from capycommon.authority import CERT_FILE
from capycommon.paths import StatePaths
from capycommon.peerfile import PeerFile
from capycommon.redistarget import read_secret
from capycommon.replication import PEER_USER, read_secrets
from capycommon.replsettings import SERVICE
from capycommon.settings import ServerSettings
from capyctl_cli import peers, programs, roles
from ports import reserved_everywhere
from support import clean_env, short_dir, wait_for

HOSTS = ("127.0.0.11", "127.0.0.12", "127.0.0.13")
KEY = "capyctl:test:replicated"


def send(client: redis.Redis, *args: str) -> Any:
    """One command as written (redis-py leaves execute_command untyped)."""
    command: Callable[..., Any] = client.execute_command
    return command(*args)


@dataclass
class Server:
    host: str
    paths: StatePaths
    redis_port: int
    sentinel_port: int
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)
    prepared: roles.Prepared | None = None

    def prepare(self, peer: PeerFile | None = None) -> roles.Prepared:
        """The state dir made ready as `capyctl start server` makes it."""
        flags: dict[str, str | None] = {
            "--enrollment-control-bind": f"{self.host}:{self.redis_port}",
            "--replication-advertise": self.host,
            "--replication-peers": ",".join(host for host in HOSTS if host != self.host),
            "--replication-sentinel-port": str(self.sentinel_port),
        }
        return roles.prepare("server", self.paths.root, None, clean_env(), flags, peer)

    def configure(self, peer: PeerFile | None = None) -> None:
        """Its state dir made ready and its configurations written, as the launcher does
        before it starts the processes."""
        self.prepared = self.prepare(peer)
        found = programs.programs("server", self.prepared)
        self.argv = {program.name: program.argv for program in found}

    def run(self, *names: str) -> None:
        """Start `names` (redis, sentinel) from the configurations written last."""
        for name in names:
            log = (self.paths.root / f"{name}.log").open("ab")
            self.procs[name] = subprocess.Popen(self.argv[name], stdout=log, stderr=log)
            log.close()
        if "redis" in names:
            wait_for(self.paths.redis_socket.exists, 10, f"{self.host}'s Redis socket")

    def start(self) -> None:
        """Its Redis and Sentinel started again, as a later start of the launcher starts
        them (asking the Sentinels which Redis is the primary)."""
        self.configure()
        self.run("redis", "sentinel")

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        self.procs.clear()
        self.paths.redis_socket.unlink(missing_ok=True)

    def control(self) -> redis.Redis:
        """Its Redis on the unix socket, as the control plane's user."""
        return redis.Redis(
            unix_socket_path=str(self.paths.redis_socket),
            username="capyctl",
            password=read_secret(self.paths.redis_password),
            protocol=2,
            retry=Retry(NoBackoff(), 0),
        )

    def sentinel(self, user: str = PEER_USER) -> redis.Redis:
        """Its Sentinel over mutual TLS, presenting the server's certificate, as a client on
        a server does."""
        shared = read_secrets(self.paths.replication_secrets)
        return redis.Redis(
            host=self.host,
            port=self.sentinel_port,
            username=user,
            password=shared.peer if user == PEER_USER else shared.discover,
            ssl=True,
            ssl_certfile=str(self.paths.server_certificate),
            ssl_keyfile=str(self.paths.server_key),
            ssl_ca_certs=str(self.paths.authority_dir / CERT_FILE),
            ssl_check_hostname=True,
            socket_timeout=2,
            protocol=2,
            retry=Retry(NoBackoff(), 0),
        )

    def primary(self) -> str | None:
        """The primary its Sentinel names; None while it does not answer."""
        try:
            with self.sentinel() as client:
                found = send(client, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        except (redis.RedisError, OSError):
            return None
        return found[0].decode() if found else None

    def read(self) -> bytes | None:
        try:
            with self.control() as client:
                value: bytes | None = client.get(KEY)
                return value
        except (redis.RedisError, OSError):
            return None


@contextmanager
def three_servers() -> Iterator[list[Server]]:
    """The three servers' state dirs, nothing started; everything they started is killed
    at the end."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; run scripts/setup")
    held = [reserved_everywhere(HOSTS), reserved_everywhere(HOSTS)]
    redis_port, sentinel_port = (sockets[0].getsockname()[1] for sockets in held)
    root = short_dir("repl")
    found = [
        Server(host, StatePaths(root / host.rsplit(".", 1)[1]), redis_port, sentinel_port)
        for host in HOSTS
    ]
    try:
        yield found
    finally:
        for server in found:
            server.kill()
        for sock in (sock for sockets in held for sock in sockets):
            sock.close()
        shutil.rmtree(root, ignore_errors=True)


def start_all(servers: list[Server]) -> None:
    """The first server as a first start makes it, the others from its peer file; their
    Sentinels once both replicas follow the first server, so that each Sentinel learns
    them at once (from the primary, which it asks every 10 s otherwise)."""
    first, *others = servers
    first.configure()
    first.run("redis")
    assert first.prepared is not None
    settings = first.prepared.loaded.settings
    assert isinstance(settings, ServerSettings)
    file = first.paths.root.parent / "server.peer"
    peerfile.write(file, peers.make(first.paths, settings))
    for server in others:
        server.configure(peerfile.read(file))
        server.run("redis")
    for server in others:
        wait_for(partial(follows, server, first.host), 10, f"{server.host} to replicate")
    for server in servers:
        server.run("sentinel")


def holds(server: Server, value: bytes) -> bool:
    return server.read() == value


def quorum(server: Server) -> str | None:
    try:
        with server.sentinel() as client:
            answer: bytes = send(client, "SENTINEL", "CKQUORUM", SERVICE)
    except (redis.RedisError, OSError):
        return None
    return answer.decode() if answer.startswith(b"OK 3 usable") else None


def knows_both_replicas(server: Server) -> bool:
    """Whether its Sentinel lists the two replicas."""
    try:
        with server.sentinel() as client:
            found = send(client, "SENTINEL", "REPLICAS", SERVICE)
    except (redis.RedisError, OSError):
        return False
    return len(found) == 2


def follows(server: Server, primary: str) -> bool:
    try:
        with server.control() as client:
            role = send(client, "ROLE")
    except (redis.RedisError, OSError):
        return False
    return bool(role[0] == b"slave" and role[1] == primary.encode() and role[3] == b"connected")


def settled(servers: list[Server]) -> None:
    """Started, and settled as a cluster that can fail over: the first server's write on
    both replicas, and every Sentinel knowing both replicas (one it does not know of is not
    told to follow a new primary)."""
    first, *others = servers
    start_all(servers)
    with first.control() as client:
        client.set(KEY, "one")
    for server in others:
        wait_for(partial(holds, server, b"one"), 10, f"{server.host} to replicate")
    for server in servers:
        what = f"{server.host}'s Sentinel to learn both replicas"
        wait_for(partial(knows_both_replicas, server), 15, what)
