"""On a server's Redis a joined host runs no script of its own: it calls the control plane's
functions, whose keys Redis holds to the host's ACL, and waits for them while they are not
loaded yet. A script that runs past the time limit is stopped by the scheduler's guard, and
Redis serves the control plane again."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from redis.exceptions import NoPermissionError, ResponseError

from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.service import REDIS_ERRORS
from capycommon.state import acl, functions, keys
from capycommon.state.pipe import RedisBusy
from capycommon.state.store import Conflict
from capycommon.state.stores import State
from capyctl_scheduler.redisguard import GUARD_EVERY_S, RedisGuard
from integration.scheduler.serverredis import PASSWORD, ServerRedis, send, server_redis
from support import instance_record, wait_for_async

ONE = "return 1"
ONE_SHA = hashlib.sha1(ONE.encode(), usedforsecurity=False).hexdigest()
# Every way to run Lua of one's own, or to change or list the functions.
SCRIPTING: tuple[tuple[str, ...], ...] = (
    ("EVAL", ONE, "0"),
    ("EVAL_RO", ONE, "0"),
    ("EVALSHA", ONE_SHA, "0"),
    ("EVALSHA_RO", ONE_SHA, "0"),
    ("SCRIPT", "LOAD", ONE),
    ("SCRIPT", "EXISTS", ONE_SHA),
    ("SCRIPT", "FLUSH"),
    ("SCRIPT", "KILL"),
    ("FUNCTION", "LOAD", "REPLACE", functions.SOURCE),
    ("FUNCTION", "DELETE", functions.LIBRARY),
    ("FUNCTION", "FLUSH"),
    ("FUNCTION", "DUMP"),
    ("FUNCTION", "RESTORE", "x"),
    ("FUNCTION", "KILL"),
    ("FUNCTION", "LIST"),
    ("FCALL_RO", functions.VERSION_FUNCTION, "0"),
)
BUSY_LOOP = "local i = 0 while true do i = i + 1 end"


@pytest.fixture
def server() -> Iterator[ServerRedis]:
    with server_redis() as found:
        found.add_host("a")
        found.add_host("b")
        found.control().function_load(functions.SOURCE, replace=True)
        yield found


def record(host: str) -> InstanceRecord:
    return instance_record("m", host, state=InstanceState.STARTING)


def test_a_hosts_user_runs_no_script_of_its_own(server: ServerRedis) -> None:
    control = server.control()
    assert control.script_load(ONE) == ONE_SHA  # loaded by the control plane: still refused
    host = server.host("a")
    for words in SCRIPTING:
        with pytest.raises(NoPermissionError, match="no permissions to run"):
            send(host, *words)
    # The library is the control plane's, as it loaded it.
    version = send(control, "FCALL_RO", functions.VERSION_FUNCTION, 0)
    assert version == functions.VERSION.encode()


@pytest.mark.anyio
async def test_a_host_writes_its_own_instances_through_the_function_and_no_others(
    server: ServerRedis,
) -> None:
    state = State(server.ahost("a"))
    try:
        store = state.instances("a")
        written = record("a")
        await store.transition(written, allowed=["absent"], generation=None, reason="test")
        assert await store.get("m", 0) == written
        with pytest.raises(Conflict) as lost:
            await store.transition(written, allowed=["absent"], generation=None, reason="again")
        assert lost.value.current == written
        # Host b's instance, written by host a through the same function: refused by the ACL.
        others = state.instances("b")
        with pytest.raises(NoPermissionError, match="no permissions to access one of the keys"):
            await others.transition(record("b"), allowed=["absent"], generation=None, reason="x")
    finally:
        await state.client.aclose()
    control = server.control()
    assert control.exists(keys.instance("b", "m", 0), keys.host_events("b")) == 0
    assert control.xlen(keys.host_events("a")) == 1


@pytest.mark.anyio
async def test_a_host_waits_for_functions_not_loaded_yet(
    server: ServerRedis, caplog: pytest.LogCaptureFixture
) -> None:
    server.control().function_flush()
    state, control = State(server.ahost("a")), State(server.acontrol())
    try:
        store = state.instances("a")
        writing = asyncio.ensure_future(
            store.transition(record("a"), allowed=["absent"], generation=None, reason="test")
        )

        async def waiting() -> bool:
            return any("no CapyCTL functions yet" in r.message for r in caplog.records)

        await wait_for_async(waiting, 10, "the host's wait for the functions")
        assert not writing.done()
        await RedisGuard(control).check()  # as the scheduler's guard does first thing
        async with asyncio.timeout(5):
            await writing
        assert await store.get("m", 0) is not None
    finally:
        await state.client.aclose()
        await control.client.aclose()


def _run_away(server: ServerRedis, words: tuple[str, ...]) -> Any:
    return send(server.control(), *words)


async def _meets_busy(server: ServerRedis, runaway: asyncio.Future[Any]) -> RedisBusy | None:
    """The control plane's commands while a script runs: answered BUSY once it passed the
    threshold (which every service rides out as an outage); None when the script was
    stopped before this client's command met it (a loaded machine may run the guard's probe
    first)."""
    client = server.acontrol()
    try:
        async with asyncio.timeout(10):
            while not runaway.done():
                try:
                    await client.get("capyctl:deployments")
                except RedisBusy as exc:
                    return exc
                await asyncio.sleep(0.01)  # a pace for the loop, not a wait on time
            return None
    finally:
        await client.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["script", "function"])
async def test_a_runaway_script_is_stopped_and_redis_serves_again(
    server: ServerRedis, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    control = server.control()
    if kind == "function":
        control.function_load(
            f"#!lua name=runaway\nredis.register_function('runaway', function() {BUSY_LOOP} end)"
        )
        words: tuple[str, ...] = ("FCALL", "runaway", "0")
    else:
        words = ("EVAL", BUSY_LOOP, "0")
    caplog.set_level(logging.INFO, "capyctl_scheduler.redisguard")
    stop = asyncio.Event()
    state = State(server.acontrol())
    guard = asyncio.ensure_future(RedisGuard(state).run(stop))
    try:
        started = time.monotonic()
        runaway = asyncio.ensure_future(asyncio.to_thread(_run_away, server, words))
        busy = await _meets_busy(server, runaway)
        assert busy is None or isinstance(busy, REDIS_ERRORS)
        with pytest.raises(ResponseError, match="killed by user"):
            async with asyncio.timeout(10):
                await runaway
        # Stopped once past the threshold (1 s), by the guard's next probe.
        assert time.monotonic() - started < 1.0 + GUARD_EVERY_S + 2.0
        assert await state.client.get("capyctl:deployments") is None

        async def serving_again() -> bool:
            return any("serves again" in r.message for r in caplog.records)

        await wait_for_async(serving_again, 5, "the guard to see Redis serving again")
        stopped = [r for r in caplog.records if "past its time limit" in r.message]
        assert len(stopped) == 1, stopped
        assert "stopped it" in stopped[0].message
    finally:
        stop.set()
        await guard
        await state.client.aclose()


def test_a_host_that_joined_under_an_older_release_loses_scripting_at_the_next_start(
    server: ServerRedis,
) -> None:
    control = server.control()
    older = [*acl.host_rules("c", server.password("c")), "+eval", "+evalsha", "+script|load"]
    send(control, "ACL", "SETUSER", acl.host_user("c"), *older)
    assert server.host("c").eval(ONE, 0) == 1
    send(control, "ACL", "SAVE")
    # What each start of the server does with the ACL file Redis saved; then loaded again.
    saved = server.paths.redis_users.read_text()
    server.paths.redis_users.write_text(acl.acl_file(PASSWORD, acl.host_lines(saved)))
    send(control, "ACL", "LOAD")
    host = server.host("c")
    with pytest.raises(NoPermissionError, match="no permissions to run the 'eval' command"):
        host.eval(ONE, 0)
    assert host.set("capyctl:host:c:x", "kept: its password and keys") is True
    with pytest.raises(NoPermissionError):
        host.set("capyctl:host:a:x", "not its key")


def test_a_host_reads_the_schedulers_epoch_and_nothing_else_of_the_lease(
    server: ServerRedis,
) -> None:
    server.control().set(keys.scheduler_epoch(), 4)
    host = server.host("a")
    assert host.get(keys.scheduler_epoch()) == b"4"
    with pytest.raises(NoPermissionError):
        host.set(keys.scheduler_epoch(), 9)
    with pytest.raises(NoPermissionError):
        host.get(keys.scheduler_lease())


def test_a_host_that_joined_before_the_lease_reads_its_epoch_after_the_next_start(
    server: ServerRedis,
) -> None:
    control = server.control()
    control.set(keys.scheduler_epoch(), 4)
    epoch_rule = f"%R~{keys.scheduler_epoch()}"
    older = [rule for rule in acl.host_rules("c", server.password("c")) if rule != epoch_rule]
    send(control, "ACL", "SETUSER", acl.host_user("c"), *older)
    with pytest.raises(NoPermissionError):
        server.host("c").get(keys.scheduler_epoch())
    send(control, "ACL", "SAVE")
    saved = server.paths.redis_users.read_text()
    server.paths.redis_users.write_text(acl.acl_file(PASSWORD, acl.host_lines(saved)))
    send(control, "ACL", "LOAD")
    assert server.host("c").get(keys.scheduler_epoch()) == b"4"
