"""`capyctl-router --role ROLE`: serve the inference API."""

from __future__ import annotations

import sys

from capycommon import credentials
from capycommon.service import ServiceContext, run, serve_http
from capycommon.settings import ServerSettings, StandaloneSettings
from capyctl_router.app import create_app


async def serve(ctx: ServiceContext) -> None:
    assert isinstance(ctx.settings, StandaloneSettings | ServerSettings)
    app = create_app(credentials.load(ctx.paths.credentials))
    await serve_http(app, ctx.settings.server.listeners.inference.bind, ctx.stop)


def main() -> None:
    sys.exit(run("router", serve))


if __name__ == "__main__":
    main()
