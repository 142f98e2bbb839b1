"""A joined host's client of replicated servers' Redis (`redistarget.joined_target` with the
servers' topology): it asks the Sentinels with its host certificate, reaches the primary as
its own Redis user (made on every server's Redis, as each server keeps its hosts' users),
reads the topology the servers published, and after the primary is lost writes on to the
new one with the same certificate and user."""

from __future__ import annotations

import asyncio
import os
import secrets
import time

import pytest

from capycommon.domain.hosts import Heartbeat
from capycommon.redistarget import RedisTarget, TlsFiles
from capycommon.service import redis_client
from capycommon.state import acl, keys
from capycommon.state.stores import State
from sentinels import HOSTS, OUTAGE_BOUND_S, Writer, across_a_failover, replicated_servers

HOST = "gpu1"


@pytest.mark.anyio
async def test_a_joined_host_reaches_the_new_primary() -> None:
    with replicated_servers() as servers:
        password = secrets.token_urlsafe(32)
        servers.make_host_user(HOST, password)
        files = TlsFiles(servers.host_certificate(HOST), servers.authority)
        target = RedisTarget(
            f"rediss://{HOSTS[0]}:{servers.redis_port}",
            acl.host_user(HOST),
            password,
            files,
            servers.topology(),
        )
        control = redis_client(servers.control_target())
        client = redis_client(target)
        try:
            await State(control).topology.publish(servers.topology())
            state = State(client)
            assert await state.topology.read() == servers.topology()

            async def beat() -> int:
                now = time.time()
                beat = Heartbeat(
                    service="hostd", pid=os.getpid(), version="0", started_at=now, last_seen=now
                )
                await state.heartbeats.beat(HOST, beat)
                return await client.hincrby(f"{keys.host_prefix(HOST)}:failover", "beats", 1)

            outage = await across_a_failover(servers, Writer(beat))
            primary = await asyncio.to_thread(servers.primary)
            assert primary is not None
            with servers.direct(primary) as found:
                assert found.exists(keys.heartbeat("hostd", HOST))
        finally:
            await client.aclose()
            await control.aclose()
    assert outage < OUTAGE_BOUND_S
