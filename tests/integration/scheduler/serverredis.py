"""A server's Redis as the server role runs it (the configuration capyctl writes, its ACL
file with the control plane's user), without the role's TLS port: hosts' users log in on
its unix socket, which Redis holds to the same ACL."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from capycommon.paths import StatePaths
from capycommon.service import redis_client
from capycommon.state import acl
from capyctl_cli import redisconf
from support import short_dir, wait_for

PASSWORD = "control-plane-password"


def send(client: redis.Redis, *args: str | int) -> Any:
    """One command as written (redis-py leaves execute_command untyped)."""
    command: Callable[..., Any] = client.execute_command
    return command(*args)


@dataclass(frozen=True)
class ServerRedis:
    paths: StatePaths

    @property
    def socket(self) -> Path:
        return self.paths.redis_socket

    def control(self) -> redis.Redis:
        return redis.Redis(
            unix_socket_path=str(self.socket),
            username=acl.CONTROL_USER,
            password=PASSWORD,
            protocol=2,
        )

    def acontrol(self) -> aioredis.Redis:
        """The control plane's client, as its services make it (BUSY read as RedisBusy)."""
        return redis_client(f"unix://{acl.CONTROL_USER}:{PASSWORD}@{self.socket}")

    def add_host(self, host: str) -> None:
        rules = acl.host_rules(host, self.password(host))
        send(self.control(), "ACL", "SETUSER", acl.host_user(host), *rules)

    def password(self, host: str) -> str:
        return f"password-of-{host}"

    def host(self, host: str) -> redis.Redis:
        """`host`'s user, one try per command (a refusal is seen at once)."""
        return redis.Redis(
            unix_socket_path=str(self.socket),
            username=acl.host_user(host),
            password=self.password(host),
            driver_info=None,
            protocol=2,
            retry=Retry(NoBackoff(), 0),
        )

    def ahost(self, host: str) -> aioredis.Redis:
        url = f"unix://{acl.host_user(host)}:{self.password(host)}@{self.socket}"
        return redis_client(url)


@contextmanager
def server_redis() -> Iterator[ServerRedis]:
    """redis-server with the configuration a server role writes, and an ACL file."""
    paths = StatePaths(short_dir("srvredis"))
    paths.redis_dir.mkdir(mode=0o700)
    paths.redis_users.write_text(acl.acl_file(PASSWORD, []))
    paths.redis_conf.write_text(redisconf.render(paths) + f"aclfile {paths.redis_users}\n")
    server = shutil.which("redis-server")
    assert server is not None, "redis-server is not installed; run scripts/setup"
    proc = subprocess.Popen([server, str(paths.redis_conf)], stdout=subprocess.DEVNULL)
    try:
        wait_for(paths.redis_socket.exists, timeout=10, what="redis-server's socket")
        yield ServerRedis(paths)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(paths.root, ignore_errors=True)
