"""The life of one CapyCTL service process.

Each service's main() calls `run`: parse the common arguments, build the settings once,
configure logging, reach Redis (or exit non-zero saying why), keep a heartbeat, run the
service's own work, and stop cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine, Sequence
from contextlib import suppress
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ReadOnlyError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from capycommon import logs
from capycommon.domain.hosts import Heartbeat
from capycommon.enrollment import incompatibility
from capycommon.errors import (
    CapyError,
    CertificateInvalid,
    CredentialsUnusable,
    HostRevoked,
    HostVersionIncompatible,
    RedisUnreachable,
)
from capycommon.paths import StatePaths, resolve_state_dir, write_atomic
from capycommon.redistarget import RedisTarget, target_for
from capycommon.settings import ROLES, AnySettings, Role, host_name, server_tag
from capycommon.settingsources import load_settings, locate_document
from capycommon.state import heartbeats, pipe
from capycommon.state.aborting import aborting
from capycommon.state.functions import FunctionsMissing
from capycommon.state.pipe import ClosingPool, ReplyParser
from capycommon.state.primary import sentinel_pool
from capycommon.state.stores import State
from capycommon.tasks import cancel_and_wait
from capycommon.version import __version__

log = logging.getLogger(__name__)

# Redis's MISCONF refusal; it lives beside the Redis connection that raises it too.
RedisCannotWrite = pipe.RedisCannotWrite


# A host's services stop for good on these: retrying cannot help, and the role stops with the
# error's exit code, which its units do not restart.
HOST_FINAL = (HostRevoked, CertificateInvalid, HostVersionIncompatible)
HOST_FINAL_EXITS = tuple(sorted({kind("").exit_code for kind in HOST_FINAL}))
# What a service rides out as an outage: Redis away, slow, unable to save, held by a script
# past its time limit (the scheduler stops it), without CapyCTL's functions (the control
# plane loads them), or a replica now (READONLY) to a client that reaches one Redis only:
# one that asks the Sentinels sees a lost connection instead, and reconnects to the primary;
# a joined host that has not learned the Sentinels yet rides it out until its services exit
# and start again with them (`capyctl_hostd.topology`).
REDIS_ERRORS = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    RedisCannotWrite,
    pipe.RedisBusy,
    FunctionsMissing,
    ReadOnlyError,
)
# Each service's connections to Redis: enough for its few blocking readers (pub/sub, stream
# reads) and many short commands at once; a command waits this long for a free one.
REDIS_CONNECTIONS = 32
REDIS_WAIT_S = 10.0
# Failures this soon after an outage ended belong to it (answers that were on their way).
OUTAGE_QUIET_S = 5.0


class Outage:
    """This process's loss of Redis, logged once: the first failure of an outage is one
    warning, its end one line, and the failures between (every request may meet one) only
    debug lines."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.since: float | None = None
        self.ended = -OUTAGE_QUIET_S
        self.unwritable = False  # Redis answers but refuses writes, until one succeeds

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, RedisCannotWrite):
            self._refused(exc)
            return
        now = self.clock()
        if self.since is not None:
            log.debug("Redis still unreachable: %s", exc)
            return
        self.since = now
        if now - self.ended >= OUTAGE_QUIET_S:
            log.warning("lost Redis; reconnecting", extra={"error": str(exc)})

    def ok(self) -> None:
        if self.since is None:
            return
        now = self.clock()
        log.info("reconnected to Redis", extra={"after_s": round(now - self.since, 1)})
        self.since = None
        self.ended = now

    def wrote(self) -> None:
        """A write succeeded: Redis is reachable and saves again."""
        self.ok()
        if self.unwritable:
            self.unwritable = False
            log.info("Redis takes writes again")

    def _refused(self, exc: RedisCannotWrite) -> None:
        if self.unwritable:
            log.debug("Redis still refuses writes: %s", exc)
            return
        self.unwritable = True
        log.error(
            "Redis refuses writes: it cannot save the role's state; free space on the disk "
            "that holds its data, and it takes writes again on its own",
            extra={"error": str(exc)},
        )


# One per process: every part of a service reports to it.
REDIS_OUTAGE = Outage()


@dataclass(frozen=True)
class ServiceContext:
    name: str
    role: Role
    settings: AnySettings
    paths: StatePaths
    document: Path | None
    host: str | None
    redis: aioredis.Redis
    stop: asyncio.Event

    @property
    def server(self) -> str:
        """A replicated server's address, which its control services' heartbeats and place
        owners carry (every server runs its own); empty elsewhere."""
        return server_tag(self.settings)

    @cached_property
    def state(self) -> State:
        """The service's stores over `redis`, built once."""
        return State(self.redis)


Body = Callable[[ServiceContext], Coroutine[Any, Any, None]]


def parse_args(name: str, argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"capyctl-{name}", description=f"CapyCTL {name}")
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--state-dir", help="the role's state dir (CAPYCTL_STATE_DIR)")
    parser.add_argument("--config", help="the role document (CAPYCTL_CONFIG)")
    return parser.parse_args(argv)


def run(
    name: str,
    body: Body | None,
    argv: Sequence[str] | None = None,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> int:
    """Run service `name` until it is told to stop, on an event loop from `loop_factory`
    (asyncio's own by default); returns the process exit code."""
    args = parse_args(name, argv)
    env = dict(os.environ)
    try:
        state_dir, _ = resolve_state_dir(args.state_dir, env)
        paths = StatePaths(state_dir)
        document = locate_document(args.config, env, paths.role_document(args.role))
        settings = load_settings(args.role, document=document, env=env).settings
    except CapyError as exc:
        logs.configure(name)
        log.error("error [%s]: %s", exc.code, exc.message)
        return exc.exit_code
    logs.configure(name, settings.log.level, settings.log.format)
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(_serve(name, args.role, settings, paths, document, body))
    except CapyError as exc:
        log.error("error [%s]: %s", exc.code, exc.message)
        if args.role == "host" and isinstance(exc, HOST_FINAL):
            with suppress(OSError):
                write_atomic(paths.host_stopped, f"{exc.code}\n{exc.message}\n")
        return exc.exit_code


async def _serve(
    name: str,
    role: Role,
    settings: AnySettings,
    paths: StatePaths,
    document: Path | None,
    body: Body | None,
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    target = target_for(settings, paths)
    client = redis_client(target)
    try:
        patience = settings.redis.unreachable_after
        await _reach_redis(client, target, patience, stop, joined_host(role, settings))
        if stop.is_set():
            return 0
        host = host_name(settings)
        ctx = ServiceContext(name, role, settings, paths, document, host, client, stop)
        if joined_host(role, settings):
            await _check_server_version(ctx.state)
        extra = {"pid": os.getpid(), "version": __version__, "redis": target.described}
        log.info("started", extra=extra)
        return await _supervise(ctx, body)
    finally:
        await client.aclose()


def redis_client(target: RedisTarget | str, connections: int = REDIS_CONNECTIONS) -> aioredis.Redis:
    """A client on at most `connections` connections: a command finding them all in use
    waits for one (up to REDIS_WAIT_S), so a service's Redis use never grows with its load,
    such as the router's requests."""
    if isinstance(target, str):
        target = RedisTarget(target)
    options: dict[str, Any] = {
        "max_connections": connections,
        "timeout": REDIS_WAIT_S,
        "socket_connect_timeout": 2,
        "socket_timeout": 5,
        "protocol": 2,
        "parser_class": ReplyParser,
    }
    if target.topology is not None:  # replicated servers: the primary, wherever it is
        pool: ClosingPool = sentinel_pool(target.topology, target.client_options(), **options)
    else:
        pool = ClosingPool.from_url(target.url, **target.client_options(), **options)
    pool.connection_class = aborting(pool.connection_class)
    return aioredis.Redis.from_pool(pool)


async def _reach_redis(
    client: aioredis.Redis,
    target: RedisTarget,
    patience: float,
    stop: asyncio.Event,
    joined: bool = False,
) -> None:
    """Wait until Redis answers, up to `patience` seconds. A `joined` host refused (its user
    removed, its certificate refused) stops for good: retrying cannot help."""
    deadline = time.monotonic() + patience
    while True:
        try:
            await client.ping()
            return
        except AuthenticationError:
            if joined:  # a joined host, whose user the server removed
                raise revoked(None) from None
            raise CredentialsUnusable(
                f"Redis at {target.described} refused this role's credentials; check "
                "redis.url's user and password"
            ) from None
        except REDIS_ERRORS as exc:
            if joined and (refusal := tls_refusal(exc)) is not None:
                raise refusal from None
            if time.monotonic() >= deadline:
                raise RedisUnreachable(
                    f"cannot reach Redis at {target.described} after {patience:g} s ({exc}); "
                    "is the role's redis-server running?"
                ) from None
        if await wait_event(stop, 0.25):
            return


async def _check_server_version(state: State) -> None:
    """A joined host refuses to run beside a server of a release line it cannot talk to."""
    server = await state.identities.server_version()
    reason = None if server is None else incompatibility(server, __version__)
    if reason is not None:
        raise HostVersionIncompatible(reason)


# What OpenSSL says when a handshake fails on a certificate rather than on the network.
_CERTIFICATE_FAILURES = (
    "CERTIFICATE_VERIFY_FAILED",
    "ALERT_UNKNOWN_CA",
    "ALERT_CERTIFICATE_EXPIRED",
    "ALERT_BAD_CERTIFICATE",
    "ALERT_CERTIFICATE_REVOKED",
    "ALERT_CERTIFICATE_UNKNOWN",
    "ALERT_CERTIFICATE_REQUIRED",
)


def tls_refusal(exc: BaseException) -> CertificateInvalid | None:
    """A joined host's TLS handshake refused on a certificate: the host's expired while it
    was away, or the server's authority changed. Retrying cannot help, so the host stops
    (exit 3, which its units do not restart) and says how to come back."""
    said = str(exc)
    if not any(marker in said for marker in _CERTIFICATE_FAILURES):
        return None
    whose = (
        "the server's certificate is not from the authority this host joined"
        if "CERTIFICATE_VERIFY_FAILED" in said
        else "the server refused this host's certificate (expired, or from another authority)"
    )
    return CertificateInvalid(
        f"{whose}: {said}; join again: on the server `capyctl revoke host NAME` and "
        "`capyctl invite host NAME --recover`, then here `capyctl join host --join-file FILE "
        "--recover`"
    )


def joined_host(role: Role, settings: AnySettings) -> bool:
    """Whether this is a host that joined a server (not one given a redis.url)."""
    return role == "host" and settings.redis.url is None


def revoked(host: str | None) -> HostRevoked:
    name = host or "NAME"
    return HostRevoked(
        f"the server refused this host's Redis credentials: host {name} was revoked "
        "(capyctl revoke host). Its engines keep running. To bring it back: on the server "
        f"`capyctl invite host {name} --recover`, then here `capyctl join host --join-file "
        "FILE --recover`"
    )


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `event`; True if it is set. A timeout of this task's
    own, not wait_for's task a wait: an idle service's loops wake several times a second, and
    each such wake cost several turns of the event loop."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def until_stop(work: asyncio.Future[Any], stop: asyncio.Event) -> None:
    """Wait until `work` is done or `stop` is set; `work` goes on either way."""
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([work, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(stopped)


T = TypeVar("T")


async def unless_stopped(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> T | None:
    """What `work` returns (or raises), or None once `stop` is set before it is done (it is
    cancelled then)."""
    task = asyncio.ensure_future(work)
    try:
        await until_stop(task, stop)
    finally:
        await cancel_and_wait(task)
    return None if task.cancelled() else task.result()


async def wait_any(*events: asyncio.Event, timeout: float) -> None:
    """Wait until one of `events` is set, or `timeout` seconds passed."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(*waits)


async def _supervise(ctx: ServiceContext, body: Body | None) -> int:
    tasks = [asyncio.create_task(_keep_heartbeat(ctx), name="heartbeat")]
    if body is not None:
        tasks.append(asyncio.create_task(body(ctx), name=ctx.name))
    stopper = asyncio.create_task(ctx.stop.wait(), name="stop")
    await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
    ctx.stop.set()
    _, running = await asyncio.wait(tasks, timeout=10)
    for task in running:
        log.warning("task %s did not stop within 10 s", task.get_name())
    await cancel_and_wait(stopper, *running)
    failures = [task.exception() for task in tasks if not task.cancelled()]
    failure = next((found for found in failures if found is not None), None)
    with suppress(*REDIS_ERRORS):
        await ctx.state.heartbeats.clear(ctx.host or "", ctx.name, os.getpid(), ctx.server)
    if failure is not None:
        raise failure
    log.info("stopped")
    return 0


async def _keep_heartbeat(ctx: ServiceContext) -> None:
    started_at = time.time()
    patience = ctx.settings.redis.unreachable_after
    lost_since: float | None = None
    while not ctx.stop.is_set():
        beat = Heartbeat(
            service=ctx.name,
            pid=os.getpid(),
            version=__version__,
            started_at=started_at,
            last_seen=time.time(),
        )
        try:
            await ctx.state.heartbeats.beat(ctx.host or "", beat, ctx.server)
            REDIS_OUTAGE.wrote()
            lost_since = None
        except AuthenticationError as exc:
            if joined_host(ctx.role, ctx.settings):
                raise revoked(ctx.host) from None
            raise CredentialsUnusable(
                f"Redis refused this service's credentials ({exc}); exiting so the supervisor "
                "restarts it with the role's current ones"
            ) from None
        except RedisCannotWrite as exc:
            REDIS_OUTAGE.failed(exc)  # reachable: a restart would not help
            lost_since = None
        except REDIS_ERRORS as exc:
            if joined_host(ctx.role, ctx.settings) and (refusal := tls_refusal(exc)) is not None:
                raise refusal from None
            REDIS_OUTAGE.failed(exc)
            if lost_since is None:
                lost_since = time.time()
            elif time.time() - lost_since > patience:
                raise RedisUnreachable(
                    f"Redis unreachable for {patience:g} s ({exc}); exiting so the "
                    "supervisor restarts this service"
                ) from None
        await wait_event(ctx.stop, heartbeats.INTERVAL_S if lost_since is None else 0.5)
