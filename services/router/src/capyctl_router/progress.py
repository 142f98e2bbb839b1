"""What a request that found its model not ready is told while it waits, when it asked
(`CapyCTL-Progress: on`): what its model is doing (starting, with how far along against
its last start on that host; waking, the same; downloading), or that it waits for a place,
whenever that changes and at least every PROGRESS_EVERY_S. A request that finds its model
ready is told nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from capycommon.domain.hosts import Download
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.service import REDIS_ERRORS
from capycommon.state.stores import State
from capycommon.units import format_size
from capyctl_router.table import Table

# A request told of its wait is told at least this often, and a read for it (the last
# start's duration, a download's bytes) is given up after this long.
PROGRESS_EVERY_S = 1.0
# The states whose progress is told against how long the last one took.
LOADING = (InstanceState.STARTING, InstanceState.WAKING)

Failed = Callable[[BaseException], None]


@dataclass
class Progress:
    """A waiting request's client, told how the wait goes: `say` sends it one line."""

    model: str  # the model id the client sent
    say: Callable[[str], Awaitable[None]]
    said: str = ""
    said_at: float = 0.0
    # The last start's or wake's duration by (host, the state it ends), read once each.
    expected: dict[tuple[str, str], float | None] = field(default_factory=dict)

    def due_in(self) -> float:
        """Seconds until the next line is due, changed or not."""
        return self.said_at + PROGRESS_EVERY_S - time.monotonic()

    async def tell(self, name: str, table: Table, state: State, failed: Failed) -> None:
        """Tell the client how its wait for deployment `name` goes, if that changed or a
        line is due; a Redis failure (`failed` hears of it) leaves the figures out."""
        instance = table.instances.get(name)
        expected: float | None = None
        download: Download | None = None
        if instance is not None and instance.state == InstanceState.STARTING:
            download = await self._download(table, state, failed, instance)
        if instance is not None and instance.state in LOADING and download is None:
            expected = await self._expected(state, failed, instance)
        ready = table.target(name) is not None
        line = progress_line(self.model, instance, ready, expected, download, time.time())
        if line != self.said or self.due_in() <= 0.01:
            self.said, self.said_at = line, time.monotonic()
            await self.say(line)

    async def _expected(
        self, state: State, failed: Failed, instance: InstanceRecord
    ) -> float | None:
        """How long the deployment's last start (or wake) took on the instance's host, read
        once a request (a failed read is tried again at the next line)."""
        key = (instance.host, str(instance.state))
        if key not in self.expected:
            try:
                async with asyncio.timeout(PROGRESS_EVERY_S):
                    found = await state.events.last_duration(
                        instance.host, instance.deployment, instance.state
                    )
            except (*REDIS_ERRORS, TimeoutError) as exc:
                failed(exc)
                return None
            self.expected[key] = found
        return self.expected[key]

    @staticmethod
    async def _download(
        table: Table, state: State, failed: Failed, instance: InstanceRecord
    ) -> Download | None:
        """The download of the model for the instance's launch, while one runs (models from
        the Hub only)."""
        record = table.records.get(instance.deployment)
        if record is None or record.document.model.hf is None:
            return None
        try:
            async with asyncio.timeout(PROGRESS_EVERY_S):
                return await state.downloads.get(instance.host, instance.deployment)
        except (*REDIS_ERRORS, TimeoutError) as exc:
            failed(exc)
            return None


def progress_line(
    model: str,
    instance: InstanceRecord | None,
    ready: bool,
    expected: float | None,
    download: Download | None,
    now: float,
) -> str:
    """What a waiting request is told: its place awaited on a `ready` model; else its
    model's download, or its start or wake, with how far along it is (the time in that state
    against the `expected` duration, below 100 %); else only that it is loading."""
    if ready:
        return f"capyctl waiting for a place on {model}"
    line = f"capyctl loading model {model}"
    if download is not None:
        done, total = format_size(download.done_bytes), format_size(download.total_bytes)
        return f"{line}, downloading {done} of {total}"
    if instance is None or instance.state not in LOADING:
        return line
    line = f"{line}, {instance.state}"
    if not expected:
        return line
    share = min(99, int(100 * max(0.0, now - instance.since) / expected))
    return f"{line} {share}%"
