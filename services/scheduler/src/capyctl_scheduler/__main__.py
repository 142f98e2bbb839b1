"""`capyctl-scheduler --role ROLE`: serve the management API and run the planning loop."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from typing import Any

from capycommon import credentials
from capycommon.httpserve import serve_http
from capycommon.redistarget import control_target
from capycommon.replication import read_secrets, topology
from capycommon.service import ServiceContext, redis_client, run
from capycommon.settings import ServerSettings, StandaloneSettings
from capycommon.settingvalues import idle_seconds
from capycommon.state.leader import server_name
from capycommon.version import __version__
from capyctl_scheduler.app import create_app
from capyctl_scheduler.enroll import Enrollment, bootstrap_app
from capyctl_scheduler.hostquota import HostQuota
from capyctl_scheduler.leadership import Leadership
from capyctl_scheduler.ledger import Limits
from capyctl_scheduler.loop import Scheduler
from capyctl_scheduler.manage import Manager
from capyctl_scheduler.observe import Observer
from capyctl_scheduler.redisguard import RedisGuard
from capyctl_scheduler.replicated import ConfirmedWrites, UserMirror
from capyctl_scheduler.snapshot import Tunables


def scheduler_for(ctx: ServiceContext) -> Scheduler:
    assert isinstance(ctx.settings, StandaloneSettings | ServerSettings)
    scheduling = ctx.settings.server.scheduling
    hosts = [] if ctx.host is None else [ctx.host]  # its own host: a standalone's, or embedded
    memory = scheduling.memory
    observer = Observer(
        ctx.state,
        hosts,
        Tunables(
            drain_timeout_s=scheduling.drain_timeout,
            park_verify_s=scheduling.park_verify_timeout,
            max_parked=scheduling.max_parked,
            demand_deadline_s=scheduling.request_deadline,
            ready_idle_s=idle_seconds(scheduling.ready_idle_timeout),
            parked_idle_s=idle_seconds(scheduling.parked_idle_timeout),
            host_lost_after_s=scheduling.host_lost_after,
        ),
        system_limits=Limits(**memory.system.model_dump()),
        gpu_limits=Limits(**memory.gpu.model_dump()),
    )
    leadership = Leadership(ctx.state.leader, server_name(ctx.paths.root))
    return Scheduler(ctx.state, observer, leadership=leadership)


async def serve(ctx: ServiceContext) -> None:
    assert isinstance(ctx.settings, StandaloneSettings | ServerSettings)
    scheduler = scheduler_for(ctx)
    leadership = scheduler.leadership
    assert leadership is not None
    for host in scheduler.observer.hosts:
        await ctx.state.host_info.join(host)
    enrollment = None
    # The guard loads CapyCTL's Redis functions first thing, and stops runaway scripts.
    work = [RedisGuard(ctx.state).run(ctx.stop), scheduler.run(ctx.stop)]
    if isinstance(ctx.settings, ServerSettings):
        enrollment = Enrollment(ctx.state, ctx.paths, ctx.settings)
        quota = ctx.settings.enrollment.host_quota_bytes
        # Only the leader cuts off hosts and signs renewals: two signers would each issue a
        # certificate for one request.
        quotas = HostQuota(ctx.state, enrollment, quota)
        work.append(leadership.during(quotas.watch, ctx.stop))
        await ctx.state.identities.set_server_version(__version__)
        tls = (ctx.paths.server_certificate, ctx.paths.server_key)
        bootstrap = ctx.settings.enrollment.bootstrap_bind
        work.append(serve_http(bootstrap_app(enrollment), bootstrap, ctx.stop, tls=tls))
        work.append(leadership.during(enrollment.watch_renewals, ctx.stop))
    app: Any = create_app(credentials.load(ctx.paths.credentials), Manager(scheduler), enrollment)
    async with AsyncExitStack() as cleanup:
        if isinstance(ctx.settings, ServerSettings) and ctx.settings.replication.enabled:
            app = await _replicated(ctx, ctx.settings, app, work, cleanup)
        management = ctx.settings.server.listeners.management.bind
        await asyncio.gather(serve_http(app, management, ctx.stop), *work)


async def _replicated(
    ctx: ServiceContext,
    settings: ServerSettings,
    app: Any,
    work: list[Coroutine[Any, Any, None]],
    cleanup: AsyncExitStack,
) -> Any:
    """A replicated server's scheduler: the Sentinels published for the hosts, the host users
    on record (those of hosts that joined before it kept one too), this server's Redis
    following them while a replica, and declarations confirmed on a replica before they are
    acknowledged."""
    found = settings.replication
    secrets = read_secrets(ctx.paths.replication_secrets)
    await ctx.state.topology.publish(topology(found.servers, found.sentinel_port, secrets))
    await ctx.state.host_users.record_held()
    local = redis_client(control_target(ctx.paths), connections=2)
    cleanup.push_async_callback(local.aclose)
    work.append(UserMirror(local).run(ctx.stop))
    return ConfirmedWrites(app, ctx.state.replicas, settings.replication.ack_timeout)


def main() -> None:
    sys.exit(run("scheduler", serve))


if __name__ == "__main__":
    main()
