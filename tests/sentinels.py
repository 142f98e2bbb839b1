"""Three replicated servers' Redis and Sentinels, as tests run them: on 127.0.0.11, .12 and
.13 (the loopback's own addresses, each a server), every Redis on one TLS port and every
Sentinel on another, the same on each server as among real ones.

Each Redis takes mutual TLS only, against one authority (`capycommon.authority`), with the
servers' certificate (valid for the three addresses, a client's too) both ways; replicates
the first server's over TLS as the replica user; and has the control plane's user, the
replication users (`capycommon.replication`) and the host users a test adds. Each Sentinel
watches them with the same certificate, logs in to each Redis as the Sentinel user and to
the other Sentinels as the peer user, and answers clients as the discover user.

`Servers.kill` kills one server's Redis and Sentinel with SIGKILL, as a machine lost;
`across_a_failover` does so while a `Writer` writes, as a service's loops do."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import redis

from capycommon import pki, replication
from capycommon.authority import CERT_FILE, Authority
from capycommon.domain.replication import Topology
from capycommon.redistarget import CONTROL_USER, PRIMARY_URL, RedisTarget, TlsFiles
from capycommon.replsettings import SERVICE
from capycommon.service import REDIS_ERRORS, Outage
from capycommon.state import acl
from ports import free_port
from support import cancel, short_dir, wait_for, wait_for_async

HOSTS = ("127.0.0.11", "127.0.0.12", "127.0.0.13")
# A primary unanswered this long is lost (the servers' default is 2 s).
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 10_000
LIFETIME = timedelta(days=1)
QUORUM = 2


@dataclass
class Servers:
    """The three servers' Redis and Sentinels, and what their clients need."""

    folder: Path
    shared: replication.Secrets
    control_password: str
    redis_port: int
    sentinel_port: int
    redis_procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    sentinel_procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def authority(self) -> Path:
        return self.folder / "ca" / CERT_FILE

    @property
    def certificate(self) -> Path:
        return self.folder / "server.pem"

    @property
    def key(self) -> Path:
        return self.folder / "server.key"

    def socket(self, host: str) -> Path:
        """One server's Redis's unix socket, as a server's own CLI reaches it."""
        return self.folder / host / "redis.sock"

    def topology(self) -> Topology:
        return replication.topology(HOSTS, self.sentinel_port, self.shared)

    def control_target(self) -> RedisTarget:
        """The primary as a server's own processes reach it (`redistarget.primary_target`):
        the control plane's user, the server certificate and its key apart."""
        files = TlsFiles(self.certificate, self.authority, key=self.key)
        return RedisTarget(PRIMARY_URL, CONTROL_USER, self.control_password, files, self.topology())

    def tls_options(self) -> dict[str, Any]:
        return {
            "ssl": True,
            "ssl_certfile": str(self.certificate),
            "ssl_keyfile": str(self.key),
            "ssl_ca_certs": str(self.authority),
        }

    def direct(self, host: str) -> redis.Redis:
        """One server's Redis, as the control plane's user (a test's own look)."""
        return redis.Redis(
            host=host,
            port=self.redis_port,
            username=CONTROL_USER,
            password=self.control_password,
            socket_timeout=2,
            **self.tls_options(),
        )

    def sentinel(self, host: str) -> redis.Redis:
        """One server's Sentinel, as the Sentinels' own user (every right)."""
        return redis.Redis(
            host=host,
            port=self.sentinel_port,
            username=replication.PEER_USER,
            password=self.shared.peer,
            socket_timeout=2,
            **self.tls_options(),
        )

    def alive(self) -> list[str]:
        return [host for host, proc in self.redis_procs.items() if proc.poll() is None]

    def primary(self) -> str | None:
        """The primary the running Sentinels agree on; None while they do not."""
        named = set()
        for host, proc in self.sentinel_procs.items():
            if proc.poll() is not None:
                continue
            with self.sentinel(host) as client:
                found = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            named.add(found[0].decode() if found else None)
        return named.pop() if len(named) == 1 else None

    def make_host_user(self, host: str, password: str) -> None:
        """A joined host's Redis user, on every server's Redis: replication carries data,
        not users."""
        for server in self.alive():
            with self.direct(server) as client:
                client.execute_command(
                    "ACL", "SETUSER", acl.host_user(host), *acl.host_rules(host, password)
                )

    def host_certificate(self, name: str) -> Path:
        """A joined host's certificate and key in one file, as `capyctl join host` keeps
        them."""
        authority = Authority.load(self.authority.parent)
        key = pki.new_private_key()
        certificate = authority.sign_request(
            pki.certificate_request(key, name),
            kind="host",
            name=name,
            identity=pki.new_identity(),
            lifetime=LIFETIME,
        )
        path = self.folder / f"{name}.pem"
        path.write_bytes(certificate + key)
        path.chmod(0o600)
        return path

    def kill(self, host: str) -> None:
        """Lose one server: its Redis and its Sentinel killed at once."""
        for proc in (self.redis_procs[host], self.sentinel_procs[host]):
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def switch_over(self) -> None:
        """An operator's failover: the Sentinels make a replica the primary while the former
        one runs on (and make it a replica some seconds later)."""
        asked = next(host for host in HOSTS if self.sentinel_procs[host].poll() is None)
        with self.sentinel(asked) as client:
            client.execute_command("SENTINEL", "FAILOVER", SERVICE)

    def role(self, host: str) -> str:
        """`master` or `slave`, as one server's Redis says."""
        with self.direct(host) as client:
            return str(client.info("replication")["role"])

    def close(self) -> None:
        for proc in (*self.redis_procs.values(), *self.sentinel_procs.values()):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def replicated_servers() -> Iterator[Servers]:
    """Three servers' Redis, the first the primary, and their Sentinels, each replica in
    sync and each Sentinel knowing the others and both replicas; stopped and removed after."""
    folder = short_dir("sentinels")
    servers = Servers(
        folder=folder,
        shared=replication.Secrets.generate(),
        control_password=secrets.token_urlsafe(32),
        redis_port=_shared_port(),
        sentinel_port=_shared_port(),
    )
    try:
        _issue_certificates(servers)
        for host in HOSTS:
            servers.redis_procs[host] = _start(_redis_conf(servers, host))
        wait_for(lambda: _replicas_online(servers) == 2, 20, "both replicas in sync")
        for host in HOSTS:
            servers.sentinel_procs[host] = _start(_sentinel_conf(servers, host), "--sentinel")
        wait_for(lambda: _sentinels_ready(servers), 20, "each Sentinel to know the others")
        yield servers
    finally:
        servers.close()


def _shared_port() -> int:
    """A port of this test process's block that is free on every server's address."""
    while True:
        port = free_port(HOSTS[0])
        if all(_free(host, port) for host in HOSTS[1:]):
            return port


def _free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _issue_certificates(servers: Servers) -> None:
    authority = Authority.create(servers.folder / "ca", "test servers' authority")
    certificate, key = authority.issue_server(list(HOSTS), LIFETIME, client=True)
    servers.certificate.write_bytes(certificate)
    servers.key.write_bytes(key)
    servers.key.chmod(0o600)


def _tls_lines(servers: Servers, host: str, port: int) -> list[str]:
    return [
        "port 0",
        f"bind {host}",
        f"tls-port {port}",
        f"tls-cert-file {servers.certificate}",
        f"tls-key-file {servers.key}",
        f"tls-ca-cert-file {servers.authority}",
        "tls-auth-clients yes",
        "tls-replication yes",
        "daemonize no",
        'logfile ""',
    ]


def _redis_conf(servers: Servers, host: str) -> Path:
    folder = servers.folder / host
    folder.mkdir()
    users = folder / "users.acl"
    lines = replication.redis_user_lines(servers.shared)
    users.write_text(acl.acl_file(servers.control_password, lines))
    conf = [
        *_tls_lines(servers, host, servers.redis_port),
        f"dir {folder}",
        f"unixsocket {folder / 'redis.sock'}",
        "unixsocketperm 700",
        'save ""',
        "appendonly no",
        f"aclfile {users}",
        f"masteruser {replication.REPLICA_USER}",
        f"masterauth {servers.shared.replica}",
        f"replica-announce-ip {host}",
    ]
    if host != HOSTS[0]:
        conf.append(f"replicaof {HOSTS[0]} {servers.redis_port}")
    path = folder / "redis.conf"
    path.write_text("\n".join(conf) + "\n")
    return path


def _sentinel_conf(servers: Servers, host: str) -> Path:
    folder = servers.folder / host / "sentinel"
    folder.mkdir()
    conf = [
        *_tls_lines(servers, host, servers.sentinel_port),
        f"dir {folder}",
        f"sentinel announce-ip {host}",
        f"sentinel monitor {SERVICE} {HOSTS[0]} {servers.redis_port} {QUORUM}",
        f"sentinel auth-user {SERVICE} {replication.SENTINEL_USER}",
        f"sentinel auth-pass {SERVICE} {servers.shared.sentinel}",
        f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
        f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
        f"sentinel sentinel-user {replication.PEER_USER}",
        f"sentinel sentinel-pass {servers.shared.peer}",
        *replication.sentinel_user_lines(servers.shared),
    ]
    path = folder / "sentinel.conf"
    path.write_text("\n".join(conf) + "\n")
    return path


def _start(conf: Path, *extra: str) -> subprocess.Popen[bytes]:
    server = shutil.which("redis-server")
    assert server is not None, "redis-server is not installed; run scripts/setup"
    log = (conf.parent / f"{conf.stem}.log").open("wb")
    with log:
        return subprocess.Popen([server, str(conf), *extra], stdout=log, stderr=log)


def _replicas_online(servers: Servers) -> int:
    """How many replicas the first server's Redis has in sync (none while it starts)."""
    try:
        with servers.direct(HOSTS[0]) as client:
            info = client.info("replication")
    except redis.ConnectionError:
        return 0
    return sum(
        1
        for name, value in info.items()
        if name.startswith("slave") and isinstance(value, dict) and value["state"] == "online"
    )


def _sentinels_ready(servers: Servers) -> bool:
    for host in HOSTS:
        try:
            with servers.sentinel(host) as client:
                state = client.sentinel_master(SERVICE)
        except redis.ConnectionError:
            return False  # not listening yet
        if state["num-other-sentinels"] != 2 or state["num-slaves"] != 2:
            return False
    return True


# The longest the client may be without Redis from the primary's loss.
OUTAGE_BOUND_S = 10.0
# The writer's pace: a service's steady writes, not a busy loop.
WRITE_EVERY_S = 0.02


class Writer:
    """Writes again and again, each failure handed to the service's outage log: what a
    service's loops do. Any failure outside REDIS_ERRORS ends it (and the test)."""

    def __init__(self, write: Callable[[], Awaitable[int]]) -> None:
        self.write = write
        self.outage = Outage()
        self.answers: list[tuple[float, int]] = []
        self.failures: list[float] = []

    async def run(self) -> None:
        while True:
            try:
                answer = await self.write()
            except REDIS_ERRORS as exc:
                self.outage.failed(exc)
                self.failures.append(time.monotonic())
            else:
                self.outage.wrote()
                self.answers.append((time.monotonic(), answer))
            await asyncio.sleep(WRITE_EVERY_S)

    def answered_since(self, moment: float) -> int:
        return sum(1 for at, _ in self.answers if at > moment)


async def across_a_failover(servers: Servers, writer: Writer) -> float:
    """Lose the primary while `writer` writes; the outage it saw, in seconds."""
    task = asyncio.create_task(writer.run())
    try:
        started = time.monotonic()

        async def some_written() -> bool:
            return writer.answered_since(started) >= 10

        await wait_for_async(some_written, 10, "writes to the first primary")
        lost = servers.primary()
        assert lost is not None
        await asyncio.to_thread(servers.kill, lost)
        killed = time.monotonic()

        async def written_again() -> bool:
            failed = [at for at in writer.failures if at > killed]
            return bool(failed) and writer.answered_since(failed[-1]) >= 10

        await wait_for_async(written_again, OUTAGE_BOUND_S + 10, "writes to a new primary")
        assert not task.done(), task  # it raised: a failure outside REDIS_ERRORS
        found = await asyncio.to_thread(servers.primary)
        assert found is not None
        assert found != lost
    finally:
        await cancel(task)
    failed = [at for at in writer.failures if at > killed]
    back = min(at for at, _ in writer.answers if at > failed[-1])
    # Each answer counts on from the one before: none the writer saw was lost.
    counted = [answer for _, answer in writer.answers]
    assert counted == sorted(set(counted)), "a write that succeeded was lost"
    return back - failed[0]
