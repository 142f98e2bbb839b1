"""The host's model store: downloads from the Hub for launches and pulls, and removals.

A complete store folder needs no request (which is how a host works offline). Otherwise
`capycommon.hub.pull` downloads it, verified and resumable; one download per store at a
time, whoever asked, and every asker's record shows the same bytes as they arrive:

- a launch's `Download` record in Redis, under its deployment, until the download ends;
- a pull's `StoreOperation` record (`capyctl model pull`), which also says how it ended.

Each download that ends (done or failed) is a host event of kind `download`, with the bytes
it received and its duration, for the router's metrics.

A removal (`capyctl model remove`) refuses while a launch uses the store (from its download
until its engine is ready) or a live instance record of this host names it. The store is
renamed out of the way in one step, then deleted, so no launch finds half of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

from capycommon.deployments.resolve import HUB_STORE, hub_origin
from capycommon.domain import commands as hc
from capycommon.domain.hosts import Download, StoreOperation
from capycommon.domain.instances import LIVE_STATES, Event
from capycommon.errors import CapyError, InvalidConfig, ModelInUse, NotFound
from capycommon.hub import HubSource, StorePaths, hub_access, is_commit, pull
from capycommon.hub.store import remove_tree
from capycommon.service import REDIS_ERRORS
from capycommon.state.store import InstanceStore
from capycommon.state.stores import State
from capycommon.tasks import cancel_and_wait
from capycommon.units import format_size

log = logging.getLogger(__name__)

# hostd writes a record at most this often while bytes arrive.
WRITE_EVERY_S = 0.25
Outcome = Literal["running", "done", "failed"]


@dataclass
class _Figures:
    """One download's figures as they arrive: where it started (resumed bytes) and where it is."""

    started: float
    first_done: int | None = None
    latest: Download | None = None
    # Those waiting for it: the last one out reports how it ended.
    waiters: int = 0

    def progress(self, wanted: hc.HubPull, done: int, total: int) -> None:
        """Note the bytes done of `total`, and the rate since the download (re)started."""
        now = time.time()
        if self.first_done is None:
            self.first_done = done
        self.latest = Download(
            repo=wanted.repo,
            commit=wanted.commit,
            done_bytes=done,
            total_bytes=total,
            rate=(done - self.first_done) / max(now - self.started, 1e-3),
            started_at=self.started,
            at=now,
        )

    async def follow(self, publish: Callable[[Download], Awaitable[None]]) -> None:
        """Publish the latest figures every WRITE_EVERY_S while they change, until cancelled."""
        told: Download | None = None
        while True:
            await asyncio.sleep(WRITE_EVERY_S)
            if self.latest is not None and self.latest is not told:
                told = self.latest
                with contextlib.suppress(*REDIS_ERRORS):
                    await publish(told)


@dataclass
class ModelStore:
    host: str
    state: State
    instances: InstanceStore
    models_root: Path
    state_dir: Path
    # The figures of each download under way, by store name, shared by all who wait for it.
    _figures: dict[str, _Figures] = field(default_factory=dict)
    # Launches using each store (from before its download to the end of the launch).
    _using: Counter[str] = field(default_factory=Counter)

    def paths(self, wanted: hc.HubPull) -> StorePaths:
        return StorePaths.of(self.models_root, self._source(wanted), wanted.commit)

    @staticmethod
    def _source(wanted: hc.HubPull) -> HubSource:
        return HubSource(wanted.repo, wanted.commit, wanted.files)

    @contextlib.asynccontextmanager
    async def using(self, wanted: hc.HubPull | None) -> AsyncIterator[None]:
        """Holds the store of a launch's model (if it is from the Hub) against removal while
        the launch downloads and starts it."""
        if wanted is None:
            yield
            return
        name = self.paths(wanted).name
        self._using[name] += 1
        try:
            yield
        finally:
            self._using[name] -= 1
            if not self._using[name]:
                del self._using[name]

    async def fetch(self, deployment: str, wanted: hc.HubPull) -> Path:
        """The store folder of a launch's model, downloaded first if it is not complete; the
        deployment's `Download` record follows the bytes."""
        key = (self.host, deployment)

        async def publish(figures: Download) -> None:
            await self.state.downloads.write(*key, figures)

        try:
            return await self._download(wanted, deployment, publish)
        finally:
            with contextlib.suppress(*REDIS_ERRORS):
                await self.state.downloads.clear(*key)

    async def pull(self, command: hc.Pull) -> None:
        """Carry out `capyctl model pull`: the store downloaded, its record saying how it
        went."""
        name = f"{HUB_STORE}/{self.paths(command.source).name}"

        async def running(figures: Download) -> None:
            await self._tell(command, name, "running", figures)

        await self._tell(command, name, "running")
        download = self._download(command.source, "", running)
        failed = f"the download of {command.source.repo} failed"
        await self._carry_out(command, name, download, failed)

    async def remove(self, command: hc.Remove) -> None:
        """Carry out `capyctl model remove`, its record saying how it went."""
        failed = f"{command.name} could not be removed"
        await self._carry_out(command, command.name, self._remove(command.name), failed)

    async def _carry_out(
        self, command: hc.StoreCommand, name: str, work: Awaitable[object], failed: str
    ) -> None:
        """Await `work`; the operation's record says how it ended (`failed`, then the
        system's words, for an OSError)."""
        try:
            await work
        except CapyError as exc:
            await self._tell(command, name, "failed", error=exc)
        except OSError as exc:
            await self._tell(command, name, "failed", error=CapyError(f"{failed}: {exc}"))
        else:
            await self._tell(command, name, "done")

    async def _tell(
        self,
        command: hc.StoreCommand,
        name: str,
        state: Outcome,
        figures: Download | None = None,
        error: CapyError | None = None,
    ) -> None:
        record = StoreOperation(
            kind=command.kind,
            state=state,
            name=name,
            download=figures,
            code=error.code if error else None,
            message=error.message if error else None,
            at=time.time(),
        )
        with contextlib.suppress(*REDIS_ERRORS):
            await self.state.downloads.write_operation(self.host, command.operation, record)

    async def _download(
        self,
        wanted: hc.HubPull,
        deployment: str,
        publish: Callable[[Download], Awaitable[None]],
    ) -> Path:
        paths = self.paths(wanted)
        if paths.complete():
            return paths.store
        access = hub_access(self.state_dir, os.environ)
        figures = self._figures.setdefault(paths.name, _Figures(started=time.time()))
        figures.waiters += 1
        writer = asyncio.create_task(figures.follow(publish))
        ended = False
        failure: CapyError | None = None
        try:
            store = await pull(
                self._source(wanted),
                self.models_root,
                endpoint=access.endpoint,
                token=access.token,
                progress=functools.partial(figures.progress, wanted),
                offline=access.offline,
            )
            ended = True
            return store
        except CapyError as exc:
            ended, failure = True, exc
            raise
        finally:
            await cancel_and_wait(writer)
            figures.waiters -= 1
            if not figures.waiters:
                del self._figures[paths.name]
                if ended and figures.latest is not None:
                    await self._ended(deployment, figures, failure)

    async def _ended(self, deployment: str, figures: _Figures, failure: CapyError | None) -> None:
        """The download's event: what it received, how long it took, how it ended."""
        latest = figures.latest
        assert latest is not None
        received = latest.done_bytes - (figures.first_done or 0)
        took = latest.at - figures.started
        how = f"failed [{failure.code}]" if failure else "done"
        event = Event(
            kind="download",
            host=self.host,
            deployment=deployment,
            instance=0,
            generation=0,
            reason=(
                f"download of {latest.repo}@{latest.commit} {how}: {format_size(received)} "
                f"received in {took:.1f} s"
            ),
            duration_s=took,
            at=time.time(),
            repo=latest.repo,
            received_bytes=received,
            outcome="failed" if failure else "done",
        )
        with contextlib.suppress(*REDIS_ERRORS):
            await self.state.events.note(event)

    async def _remove(self, name: str) -> None:
        folder = store_folder(name)
        store = self.models_root / HUB_STORE / folder
        if folder in self._figures or self._using[folder]:
            raise ModelInUse(
                f"{name} is being downloaded or started on host {self.host}; remove it once "
                "no deployment uses it"
            )
        for record in await self.instances.all():
            if record.state in LIVE_STATES and _within(record.model_path, store):
                raise ModelInUse(
                    f"{name} runs in deployment {record.deployment!r} on host {self.host}; delete "
                    f"the deployment first (capyctl delete deployment {record.deployment})"
                )
        paths = StorePaths(self.models_root / "sources", folder)
        if not store.exists() and not paths.partial_dir.exists():
            raise NotFound(
                f"no download {name} on host {self.host}; list them with capyctl list models"
            )
        gone = paths.private / "removing" / f"{folder}.{secrets.token_hex(4)}"
        gone.parent.mkdir(parents=True, exist_ok=True)
        if store.exists():
            os.rename(store, gone)  # in one step: a launch finds all of it or nothing
        await asyncio.to_thread(remove_tree, gone)
        await asyncio.to_thread(remove_tree, paths.partial_dir)
        log.info("removed %s", name)


def store_folder(name: str) -> str:
    """The store folder a removal names (`sources/huggingface/<owner>--<name>@<commit>...`, as
    `capyctl list models` shows it); refuses anything else."""
    path = PurePosixPath(name)
    repo, commit = hub_origin(name)
    if (
        repo is None
        or commit is None
        or not is_commit(commit)
        or path.parent != PurePosixPath(HUB_STORE)
        or path.name in ("", ".", "..")
    ):
        raise InvalidConfig(
            f"{name!r} is not a download in the model store; capyctl model remove takes a name "
            f"{HUB_STORE}/<owner>--<name>@<commit> from capyctl list models (a folder of your "
            "own under the models root is yours to delete)"
        )
    return path.name


def _within(path: str | None, folder: Path) -> bool:
    return path is not None and (Path(path) == folder or folder in Path(path).parents)
