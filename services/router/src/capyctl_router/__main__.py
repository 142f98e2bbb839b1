"""`capyctl-router --role ROLE`: serve the inference API."""

from __future__ import annotations

import asyncio
import sys

import httpx

from capycommon import credentials
from capycommon.service import ServiceContext, run, serve_http
from capycommon.settings import ServerSettings, StandaloneSettings
from capyctl_router.app import Router, create_app
from capyctl_router.dispatch import Dispatcher, Limits
from capyctl_router.metrics import Metrics
from capyctl_router.table import Table


async def serve(ctx: ServiceContext) -> None:
    assert isinstance(ctx.settings, StandaloneSettings | ServerSettings)
    server = ctx.settings.server
    hosts = {ctx.settings.host.name} if isinstance(ctx.settings, StandaloneSettings) else set()
    table = Table(ctx.redis, hosts)
    limits = Limits(
        waiting_per_deployment=server.routing.max_pending_per_deployment,
        waiting_total=server.routing.max_pending_total,
        request_deadline_s=server.scheduling.request_deadline,
        stream_idle_s=server.routing.stream_idle_timeout,
    )
    metrics = Metrics()
    dispatcher = Dispatcher(ctx.redis, table, metrics, limits)
    # Engines are on loopback (or a host's ingress); no proxy variables apply, no pool limit
    # below the router's own admission, and no overall timeout (deadlines are the router's).
    limits_http = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=10.0), limits=limits_http, trust_env=False
    ) as http:
        router = Router(dispatcher, http)
        app = create_app(credentials.load(ctx.paths.credentials), router)
        await table.sync()
        for name in table.records:  # this router holds no request yet
            await dispatcher.book.reset(name)
        await asyncio.gather(
            serve_http(app, server.listeners.inference.bind, ctx.stop, server.listeners.inference),
            table.run(ctx.stop),
            dispatcher.settle(ctx.stop),
            metrics.follow_events(ctx.redis, lambda: table.hosts, ctx.stop),
        )


def main() -> None:
    sys.exit(run("router", serve))


if __name__ == "__main__":
    main()
