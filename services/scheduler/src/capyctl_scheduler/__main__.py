"""`capyctl-scheduler --role ROLE`: serve the management API and make decisions."""

from __future__ import annotations

import sys

from capycommon import credentials
from capycommon.service import ServiceContext, run, serve_http
from capycommon.settings import ServerSettings, StandaloneSettings
from capyctl_scheduler.app import create_app


async def serve(ctx: ServiceContext) -> None:
    assert isinstance(ctx.settings, StandaloneSettings | ServerSettings)
    app = create_app(credentials.load(ctx.paths.credentials))
    await serve_http(app, ctx.settings.server.listeners.management.bind, ctx.stop)


def main() -> None:
    sys.exit(run("scheduler", serve))


if __name__ == "__main__":
    main()
