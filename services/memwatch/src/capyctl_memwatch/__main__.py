"""`capyctl-memwatch --role ROLE`: measure this host's memory and write it to Redis."""

from __future__ import annotations

import asyncio
import sys

from capycommon.errors import InvalidConfig
from capycommon.hostsettings import HostSection
from capycommon.service import ServiceContext, run
from capycommon.settings import own_host
from capyctl_memwatch.choose import open_backend
from capyctl_memwatch.hostram import HostRamReader
from capyctl_memwatch.watch import watch


def _host_section(ctx: ServiceContext) -> HostSection:
    host = own_host(ctx.settings)
    if ctx.host is None or host is None:
        raise InvalidConfig(f"memwatch runs on a GPU host; the {ctx.role} role has none")
    return host


async def serve(ctx: ServiceContext) -> None:
    """Choose the backend once, then write readings and startup peaks until told to stop."""
    section = _host_section(ctx)
    assert ctx.host is not None
    backend = await asyncio.to_thread(open_backend, section, ctx.paths.root, HostRamReader())
    try:
        await watch(ctx.state, ctx.host, backend, ctx.stop)
    finally:
        backend.close()


def main() -> None:
    sys.exit(run("memwatch", serve))


if __name__ == "__main__":
    main()
