"""`capyctl-hostd --role ROLE`: the owner of this host's engine processes."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from capycommon.engines import publish, registry
from capycommon.errors import CapyError
from capycommon.service import ServiceContext, run

log = logging.getLogger(__name__)


async def serve(ctx: ServiceContext) -> None:
    """Publish the engines registered on this machine, then keep the host's heartbeat."""
    assert ctx.host is not None
    try:
        engines = registry.read(registry.locate(ctx.document, Path.home()))
    except CapyError as exc:
        log.error("no engines published: error [%s]: %s", exc.code, exc.message)
        await ctx.stop.wait()
        return
    await publish.publish(ctx.redis, ctx.host, engines)
    log.info(
        "published engines",
        extra={"source": str(engines.path), "revision": engines.revision,
               "profiles": sorted(engines.document.profiles)},
    )  # fmt: skip
    await ctx.stop.wait()


def main() -> None:
    sys.exit(run("hostd", serve))


if __name__ == "__main__":
    main()
