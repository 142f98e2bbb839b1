"""`capyctl-hostd --role ROLE`: the owner of this host's engine processes."""

from __future__ import annotations

import asyncio
import logging
import sys
from contextlib import AbstractAsyncContextManager, nullcontext
from pathlib import Path

from capycommon.domain.hosts import HOST_CAPABILITIES, HostInfo
from capycommon.engines import registry
from capycommon.enrollment import ingress_address
from capycommon.errors import CapyError, InvalidConfig
from capycommon.paths import ensure_private_dir
from capycommon.service import REDIS_ERRORS, ServiceContext, joined_host, run, wait_event
from capycommon.settings import HostSettings, own_host
from capycommon.settingvalues import parse_port_range
from capycommon.tasks import beside
from capycommon.version import __version__
from capyctl_hostd import adopt, consumer, loads, renewal, topology
from capyctl_hostd.hostpaths import HostPaths
from capyctl_hostd.ingress import HostIngress
from capyctl_hostd.modelfacts import Shelf
from capyctl_hostd.ports import PortLeaser
from capyctl_hostd.runner import Runner
from capyctl_hostd.serving import Serving

log = logging.getLogger(__name__)


def host_paths(ctx: ServiceContext) -> HostPaths:
    host = own_host(ctx.settings)
    assert host is not None
    simgpu = None
    if host.simulated_gpus is not None:
        simgpu = host.simgpu_dir or ctx.paths.root / "simgpu"
    return HostPaths(
        engines_file=registry.locate(ctx.document, Path.home()),
        engines_record=ctx.paths.engines_record,
        runtime_dir=ctx.paths.root / "runtime",
        logs_dir=ctx.paths.logs_dir / "engines",
        home=Path.home(),
        simgpu_dir=simgpu,
        models_root=Path(host.models_root).expanduser(),
        state_dir=ctx.paths.root,
    )


async def publish_engines(ctx: ServiceContext, paths: HostPaths) -> None:
    assert ctx.host is not None
    try:
        engines = registry.read(paths.engines_file)
    except CapyError as exc:
        log.error("no engines published: error [%s]: %s", exc.code, exc.message)
        return
    await ctx.state.engines.publish(ctx.host, engines)
    log.info(
        "published engines",
        extra={
            "source": str(engines.path),
            "revision": engines.revision,
            "profiles": sorted(engines.document.profiles),
        },
    )


async def serve(ctx: ServiceContext) -> None:
    """Publish what the host says of itself, its models and its engines, re-adopt what runs
    (and stop what runs uncounted), then carry out commands, watch for engines that die or
    lose their records, publish the serving engines' load and keep the models' facts current,
    until stopped. A joined host also keeps its certificate renewed, serves its ingress,
    where the server's router reaches its engines, and keeps the servers' topology in its
    joined file (`topology`).

    Stopping hostd leaves the engines running: the next hostd re-adopts them.
    """
    assert ctx.host is not None
    host = own_host(ctx.settings)
    if host is None:
        raise InvalidConfig(f"hostd runs on a GPU host; the {ctx.role} role has none")
    paths = host_paths(ctx)
    ensure_private_dir(paths.engines_record.parent)
    deep_park = host.deep_park == "on"
    shelf = Shelf(ctx.state, ctx.host, host.models_root, state_dir=paths.state_dir)
    ports = PortLeaser(*parse_port_range(host.engine_ports))
    runner = Runner(
        ctx.host,
        ctx.state,
        ctx.state.instances(ctx.host),
        ports,
        paths,
        deep_park=deep_park,
        telemetry=host.engine_telemetry == "allow",
        retention_zero=host.retention == "zero",
    )
    door: HostIngress | None = None
    info = HostInfo(
        version=__version__,
        capabilities=HOST_CAPABILITIES,
        deep_park=deep_park,
        lmcache=host.lmcache != "off",
        retention_zero=host.retention == "zero",
    )
    following: AbstractAsyncContextManager[object] = nullcontext()
    if joined_host(ctx.role, ctx.settings):
        assert isinstance(ctx.settings, HostSettings)
        door = HostIngress.open(ctx.settings.host.ingress.bind, ctx.paths)
        info = info.model_copy(update={"ingress": ingress_address(ctx.settings)})
        # From the moment hostd reached Redis, while it starts too: a host that reached a
        # replica cannot start until it comes back knowing the Sentinels.
        following = beside(topology.follow(ctx.state, ctx.paths, ctx.stop), "topology")
    async with following:
        if await start(ctx, info, shelf, runner):
            await carry_on(ctx, runner, shelf, door)


async def carry_on(
    ctx: ServiceContext, runner: Runner, shelf: Shelf, door: HostIngress | None
) -> None:
    """Carry out commands, watch the engines, publish their load and keep the models' facts
    current (and, on a joined host, renew its certificate and serve its ingress) until
    stopped."""
    work = [
        consumer.consume(runner, shelf, ctx.stop),
        adopt.watch(runner, ctx.stop),
        loads.publish(runner, ctx.stop),
        shelf.watch(ctx.stop),
    ]
    if door is not None:
        work.append(renewal.keep_certificate(ctx, renewed=door.reload))
        serving = Serving(runner.store, runner.state, runner.host)
        work.append(door.serve(runner.holdings.engines, serving, ctx.stop))
    try:
        await asyncio.gather(*work)
    finally:
        for engine in runner.holdings.engines.values():  # the engines run on; hostd's clients end
            await engine.close_controls()


async def start(ctx: ServiceContext, info: HostInfo, shelf: Shelf, runner: Runner) -> bool:
    """Publish what the host says of itself, its models and its engines, then re-adopt what
    runs; False when hostd is stopped first. Every step is safe to repeat: a Redis blip while
    starting is ridden out like one later (the heartbeat gives up, and hostd exits, only once
    Redis stays away too long)."""
    assert ctx.host is not None
    while True:
        try:
            await ctx.state.host_info.publish(ctx.host, info)
            await shelf.start()
            await publish_engines(ctx, runner.paths)
            await adopt.adopt_all(runner)
            return True
        except REDIS_ERRORS as exc:
            log.warning("lost Redis while starting; trying again: %s", exc)
            if await wait_event(ctx.stop, 0.5):
                return False


def main() -> None:
    sys.exit(run("hostd", serve))


if __name__ == "__main__":
    main()
