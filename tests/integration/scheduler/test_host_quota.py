"""A host's share of the server's Redis is bounded: no single value over the bound of the
configuration capyctl writes, and a host whose keys take more than its quota is cut off as
a revocation does it, its keys dropped, while Redis goes on serving the control plane."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import cast

import pytest
import redis
from redis.exceptions import AuthenticationError

from capycommon.domain.hosts import HostIdentity
from capycommon.settings import ServerSettings
from capycommon.state import keys
from capycommon.state.stores import State
from capycommon.version import __version__
from capyctl_scheduler.enroll import Enrollment
from capyctl_scheduler.hostquota import CUT_OFF, HostQuota
from integration.scheduler.serverredis import ServerRedis, send, server_redis
from support import instance_record

MiB = 1 << 20
QUOTA = 16 * MiB


@pytest.fixture
def server() -> Iterator[ServerRedis]:
    with server_redis() as found:
        yield found


async def join(server: ServerRedis, host: str) -> None:
    """Host `host` joined, as enrollment leaves it: its record, its name, its user."""
    state = State(server.acontrol())
    try:
        now = time.time()
        identity = HostIdentity(
            name=host,
            host_id=f"id-{host}",
            serial=f"serial-{host}",
            not_after=now + 86400,
            version=__version__,
            joined_at=now,
        )
        await state.identities.put(identity)
        await state.host_info.join(host)
        await state.host_users.set(host, server.password(host))
    finally:
        await state.client.aclose()


def test_a_value_over_the_bound_is_refused(server: ServerRedis) -> None:
    server.add_host("a")
    host = server.host("a")
    with pytest.raises((redis.ConnectionError, redis.ResponseError)):
        host.set("capyctl:host:a:big", b"x" * (8 * MiB + 1))
    assert server.control().exists("capyctl:host:a:big") == 0
    # Up to the bound is taken: several times the largest value CapyCTL writes (1 MiB).
    assert server.host("a").set("capyctl:host:a:big", b"x" * (8 * MiB)) is True


@pytest.mark.anyio
async def test_a_host_over_its_quota_is_cut_off_and_redis_serves_on(
    server: ServerRedis, caplog: pytest.LogCaptureFixture
) -> None:
    await join(server, "a")
    await join(server, "b")
    greedy, modest = server.host("a"), server.host("b")
    for index in range(3):
        assert greedy.set(f"capyctl:host:a:junk:{index}", b"x" * (7 * MiB)) is True
    assert modest.set("capyctl:host:b:heartbeat:hostd", "{}") is True
    live = instance_record("m", "a")
    greedy.set(keys.instance("a", "m", 0), live.model_dump_json())
    greedy.sadd(keys.instances("a"), "m:0")
    assert greedy.ping() is True  # a connection open before the cut
    state = State(server.acontrol())
    caplog.set_level(logging.INFO, "capyctl_scheduler.hostquota")
    try:
        assert await state.host_keys.size("a") > QUOTA
        quota = HostQuota(state, Enrollment(state, server.paths, ServerSettings()), QUOTA)
        assert await quota.sweep() == ["a"]

        # Cut off: its open connection closed, its user gone, its keys dropped but for the
        # record of its live engine, which runs on and stays charged.
        with pytest.raises((redis.ConnectionError, AuthenticationError)):
            greedy.ping()
        with pytest.raises(AuthenticationError):
            server.host("a").ping()
        control = server.control()
        assert sorted(control.keys("capyctl:host:a:*")) == [
            keys.instance("a", "m", 0).encode(),
            keys.instances("a").encode(),
        ]
        assert await state.instances("a").all() == [live]
        revoked = await state.identities.get("a")
        assert revoked is not None
        assert revoked.revoked_at is not None
        # Host b, under its quota, and Redis for the control plane: as they were.
        assert modest.get("capyctl:host:b:heartbeat:hostd") == b"{}"
        assert (await state.identities.get("b")) is not None
        assert await state.client.ping() is True

        choices = await state.choices.recent(5)
        assert [(d.kind, d.host) for d in choices] == [(CUT_OFF, "a")]
        assert "over its quota of 16.0 MiB" in choices[0].reason

        # Measured again: nothing more to do, nothing logged again.
        assert await quota.sweep() == []
        cuts = [r for r in caplog.records if r.message.startswith("cut off host a")]
        assert len(cuts) == 1
    finally:
        await state.client.aclose()
    assert control.exists(keys.host_identity("a")) == 1  # the server's record of it stays


@pytest.mark.anyio
async def test_measuring_a_host_costs_redis_little_whatever_its_keys(server: ServerRedis) -> None:
    """A hash of 200,000 fields (a host's user may HSET) counted whole would hold Redis about
    a tenth of a second at each sweep; it is counted from a sample, close to its size."""
    control = server.control()
    with control.pipeline(transaction=False) as pipe:
        for start in range(0, 200_000, 5000):
            pipe.hset(
                "capyctl:host:a:wide",
                mapping={f"f{i}": "v" * 20 for i in range(start, start + 5000)},
            )
        pipe.rpush("capyctl:host:a:list", *(b"x" * 1000 for _ in range(3000)))
        pipe.execute()
    exact = sum(
        cast(int, control.memory_usage(k, samples=0)) for k in control.keys("capyctl:host:a:*")
    )
    send(control, "CONFIG", "RESETSTAT")
    state = State(server.acontrol())
    try:
        measured = await state.host_keys.size("a")
    finally:
        await state.client.aclose()
    assert abs(measured - exact) < exact * 0.1, (measured, exact)
    spent = control.info("commandstats")["cmdstat_memory|usage"]["usec"]
    assert spent < 20_000, f"MEMORY USAGE held Redis {spent} µs"
