"""A launch's model download from the Hub, before its engine starts.

A complete store folder needs no request (which is how a host works offline). Otherwise
`capycommon.hub.pull` downloads it, verified and resumable, and the deployment's `Download`
record in Redis shows the bytes as they arrive, until the download ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import redis.asyncio as aioredis

from capycommon.hub import HubSource, StorePaths, hub_access, pull
from capycommon.service import REDIS_ERRORS
from capycommon.state import downloads
from capycommon.state.downloads import Download
from capycommon.state.hostcommands import HubPull

# hostd writes the record at most this often while bytes arrive.
WRITE_EVERY_S = 0.25


async def fetch(
    client: aioredis.Redis,
    host: str,
    deployment: str,
    wanted: HubPull,
    models_root: Path,
    state_dir: Path,
) -> Path:
    """The model's store folder, downloaded first if it is not complete."""
    source = HubSource(wanted.repo, wanted.commit, wanted.files)
    paths = StorePaths.of(models_root, source, wanted.commit)
    if paths.complete():
        return paths.store
    access = hub_access(state_dir, os.environ)
    started = time.time()
    latest: Download | None = None

    def progress(done: int, total: int) -> None:
        nonlocal latest
        now = time.time()
        latest = Download(
            repo=wanted.repo,
            commit=wanted.commit,
            done_bytes=done,
            total_bytes=total,
            rate=done / max(now - started, 1e-3),
            started_at=started,
            at=now,
        )

    async def publish() -> None:
        told: Download | None = None
        while True:
            await asyncio.sleep(WRITE_EVERY_S)
            if latest is not None and latest is not told:
                told = latest
                with contextlib.suppress(*REDIS_ERRORS):
                    await downloads.write(client, host, deployment, told)

    writer = asyncio.create_task(publish())
    try:
        return await pull(
            source,
            models_root,
            endpoint=access.endpoint,
            token=access.token,
            progress=progress,
            offline=access.offline,
        )
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
        with contextlib.suppress(*REDIS_ERRORS):
            await downloads.clear(client, host, deployment)
