"""One router worker: the inference API on the listener its parent holds (`workers`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from collections.abc import Sequence
from pathlib import Path

import uvloop
from prometheus_client import values

from capycommon import credentials
from capycommon.domain.places import owner_id
from capycommon.engineclient import Engines
from capycommon.httpserve import serve_http
from capycommon.service import REDIS_ERRORS, ServiceContext, run
from capycommon.settings import ServerSettings, StandaloneSettings
from capyctl_router.app import Router, create_app
from capyctl_router.dispatch import Dispatcher, Limits
from capyctl_router.metrics import Metrics
from capyctl_router.remote import client_context
from capyctl_router.table import Table

# Names the folder of Prometheus's multiprocess mode, for the workers' metrics.
METRICS_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
# How long the router keeps an idle connection to an engine for the next request.
ENGINE_KEEPALIVE_S = 2.0


def worker_name(index: int) -> str:
    return f"router-{index}"


def main(index: int, argv: Sequence[str], listener: socket.socket, metrics: Path) -> int:
    """Run worker `index` in a process just forked from the parent; its exit code.

    Its metrics are Prometheus's multiprocess values in the `metrics` folder: the client
    library chose its kind of value when the parent loaded it, before the folder was made,
    so it is chosen again here. A worker's event loop is libuv's (uvloop): in bench/router.py
    it served more short chats a second at concurrency 32 than asyncio's loop (0.50 and 0.47
    of direct against 0.46 and 0.46); at concurrency 1 the processes' hand-offs, not the
    loop, cost the time."""
    os.environ[METRICS_VARIABLE] = str(metrics)
    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    body = functools.partial(serve, listener=listener, events=index == 0)
    return run(worker_name(index), body, argv, loop_factory=uvloop.new_event_loop)


async def serve(ctx: ServiceContext, listener: socket.socket, events: bool) -> None:
    """One worker: the inference API on the parent's listener. `events`: this worker turns
    the hosts' events into the lifecycle metrics (one does, for all)."""
    assert isinstance(ctx.settings, StandaloneSettings | ServerSettings)
    server = ctx.settings.server
    # Its own host's engines (a standalone's, or a server's embedded host's) on loopback.
    hosts = set() if ctx.host is None else {ctx.host}
    table = Table(ctx.state, hosts)
    limits = Limits(
        waiting_per_deployment=server.routing.max_pending_per_deployment,
        waiting_total=server.routing.max_pending_total,
        request_deadline_s=server.scheduling.request_deadline,
        stream_idle_s=server.routing.stream_idle_timeout,
        workers=server.router.worker_count,
    )
    metrics = Metrics()
    owner = owner_id(ctx.name, os.getpid(), ctx.server)
    dispatcher = Dispatcher(ctx.state, table, metrics, limits, owner=owner)
    # An idle connection to an engine is dropped well before the engine closes it (uvicorn's
    # keep-alive, vLLM's and SGLang's, is 5 s), so a request is never sent on one being closed.
    # A server's router reaches every engine through its host's ingress, over TLS.
    tls = client_context(ctx.paths) if isinstance(ctx.settings, ServerSettings) else None
    engines = Engines(keepalive_s=ENGINE_KEEPALIVE_S, tls=tls)
    router = Router(dispatcher, engines, server.listeners.inference.body_timeout)
    app = create_app(credentials.load(ctx.paths.credentials), router)
    await table.sync()
    work = [
        serve_http(
            app, server.listeners.inference.bind, ctx.stop, server.listeners.inference, listener
        ),
        table.run(ctx.stop),
        dispatcher.settle(ctx.stop),
    ]
    if events:
        folder = os.environ.get(METRICS_VARIABLE)
        where = Path(folder) if folder else None
        work.append(metrics.follow_events(ctx.state, lambda: table.hosts, ctx.stop, where))
    try:
        await asyncio.gather(*work)
    finally:
        engines.close()
        with contextlib.suppress(*REDIS_ERRORS):  # else they expire with this worker
            await ctx.state.places.drop_owner(owner)
