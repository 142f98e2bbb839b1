"""Downloading one repository at one commit into the model store.

`pull` resolves the revision, lists the files, checks the disk, downloads every file into its
partial file (resumed with `Range` across tries and runs), verifies each against the Hub's
listing, and only then moves the whole tree into the store in one rename. A store that is
already complete is returned with no request at all.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx

from capycommon.domain.models import weights_of
from capycommon.errors import CapyError
from capycommon.hub.client import FileTarget, HubClient, HubLimits
from capycommon.hub.errors import DiskFull, HfIntegrity, HfOfflineMissing, HfUnreachable
from capycommon.hub.integrity import Expected, StreamHash, content_range_start
from capycommon.hub.source import HubSource, is_commit
from capycommon.hub.store import (
    Plan,
    Stored,
    StorePaths,
    check_room,
    commit_store,
    make_private,
    partial_bytes,
    plan_from_tree,
)

Progress = Callable[[int, int], None]

_CHUNK = 1 << 16
_PROGRESS_EVERY_S = 0.1
_LOCK_POLL_S = 0.2
# A wait on another process's download of the same store is logged once it lasts this long.
_LOCK_TELL_AFTER_S = 5.0

log = logging.getLogger(__name__)


class _Meter:
    """Bytes done out of the plan's total, told to `progress` at the start (the bytes resumed),
    at most every 0.1 s, and at the end."""

    def __init__(self, total: int, done: int, progress: Progress | None) -> None:
        self.total = total
        self.done = done
        self._progress = progress
        self._told = 0.0

    def add(self, count: int) -> None:
        self.done += count
        now = time.monotonic()
        if self._progress is not None and now - self._told >= _PROGRESS_EVERY_S:
            self._told = now
            self._progress(self.done, self.total)

    def tell(self) -> None:
        if self._progress is not None:
            self._told = time.monotonic()
            self._progress(self.done, self.total)


class _Restart(Exception):
    """The server answered a resumed GET with a range we did not ask for: start from zero."""


class _Transient(Exception):
    """A GET the server failed (5xx): worth another try, resuming."""

    def __init__(self, error: CapyError) -> None:
        super().__init__(error.message)
        self.error = error


async def _fetch_once(
    client: HubClient,
    target: FileTarget,
    partial: Path,
    digest: StreamHash,
    meter: _Meter,
    repo: str,
) -> None:
    """One GET appending to `partial` from its current length, fed to `digest`; returns when
    the body ends, short or not. A 200 to a `Range` request is the whole file: `partial` and
    `digest` restart from zero with it. Raises `_Restart` for a 206 that starts elsewhere or
    a 416."""
    offset = digest.count
    async with client.stream(target, offset) as response:
        status = response.status_code
        if status == 416 or (
            status == 206 and content_range_start(response.headers.get("content-range")) != offset
        ):
            raise _Restart
        if status not in (200, 206):
            error = client.failed(response, f"download {digest.expected.path}", repo)
            raise _Transient(error) if status >= 500 else error
        mode = "ab"
        if status == 200 and offset:
            meter.done -= offset
            digest.reset()
            mode = "wb"
        with partial.open(mode) as out:
            async for chunk in response.aiter_raw(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                meter.add(len(chunk))
                if digest.count > digest.expected.size:
                    break


def _resume(partial: Path, file: Expected, meter: _Meter) -> StreamHash:
    """A digest of the bytes already in `partial`, or of none (and no partial file) when they
    cannot be the start of `file`."""
    digest = StreamHash(file)
    if partial.exists():
        if partial.stat().st_size <= file.size:
            digest.feed_file(partial)
        else:
            partial.unlink()
    return digest


def _broken(partial: Path, plan: Plan, problem: str) -> HfIntegrity:
    partial.unlink(missing_ok=True)
    return HfIntegrity(
        f"{plan.source.repo}@{plan.commit}: {problem}; the file's partial download was deleted "
        "and nothing entered the store; try again, and if it persists the Hub or a proxy serves "
        "other bytes than it lists"
    )


async def _download(
    client: HubClient, plan: Plan, paths: StorePaths, file: Expected, meter: _Meter
) -> Stored:
    """`file` complete and verified in its partial file, within `limits.attempts` tries, each
    resuming from the bytes the partial file holds."""
    partial = paths.partial(file.path)
    make_private(partial.parent)
    digest = _resume(partial, file, meter)
    partial.touch()  # an empty file needs no request, but a file to move into the store
    target: FileTarget | None = None
    failure: CapyError | None = None
    what = f"download {file.path} of {plan.source.repo}"
    for attempt in range(client.limits.attempts):
        if digest.count >= file.size:
            break
        if attempt:
            await asyncio.sleep(client.limits.backoff(attempt - 1))
        try:
            if target is None:  # its own retries: a failure here ends the download
                target = await client.locate(plan.source, plan.commit, file)
            await _fetch_once(client, target, partial, digest, meter, plan.source.repo)
        except HfIntegrity as exc:
            raise _broken(partial, plan, exc.message) from None
        except _Restart:
            meter.done -= digest.count
            partial.write_bytes(b"")
            digest.reset()
            failure = HfUnreachable(f"the Hub at {client.endpoint} would not resume {file.path}")
        except _Transient as exc:
            failure = exc.error
        except httpx.TransportError as exc:
            failure = client.unreachable(exc, what)
        else:
            short = f"the body ended after {digest.count} of {file.size} bytes"
            failure = client.unreachable(ConnectionError(short), what)
    if digest.count < file.size:
        assert failure is not None
        raise failure.retold(
            f"{failure.message}; {digest.count} of {file.size} bytes are kept, and the next try "
            "resumes from them"
        )
    problem = digest.mismatch()
    if problem is not None:
        raise _broken(partial, plan, problem)
    return Stored(file.path, file.size, digest.sha256)


@asynccontextmanager
async def _process_lock(paths: StorePaths) -> AsyncIterator[None]:
    """Holds the store's lock file against other processes (polled, so it can be cancelled)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    make_private(paths.lock.parent)
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    waited = 0.0
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if waited < _LOCK_TELL_AFTER_S <= waited + _LOCK_POLL_S:
                    log.info("waiting for another process's download", extra={"lock": paths.lock})
                waited += _LOCK_POLL_S
                await asyncio.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)


async def _pull_commit(
    client: HubClient,
    source: HubSource,
    commit: str,
    paths: StorePaths,
    progress: Progress | None,
) -> Path:
    async with _process_lock(paths):
        if paths.complete():
            return paths.store
        if paths.store.exists():
            raise HfIntegrity(
                f"{paths.store} exists but has no manifest, so it is not a complete download; "
                "remove it and try again"
            )
        plan = plan_from_tree(source, commit, await client.tree(source, commit))
        done = partial_bytes(paths, plan)
        make_private(paths.partial_dir)
        paths.store.parent.mkdir(parents=True, exist_ok=True)
        check_room(plan.total_size - done, paths.root, reserve=client.limits.reserve_bytes)
        meter = _Meter(plan.total_size, done, progress)
        meter.tell()
        try:
            stored = [await _download(client, plan, paths, file, meter) for file in plan.files]
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise DiskFull(
                f"the filesystem of {paths.root} ran out of space while downloading "
                f"{source.repo}; free space there and pull again: the download resumes"
            ) from None
        meter.tell()
        return commit_store(paths, plan, stored)


# One download per store in this process: a second `pull` of the same store waits for the
# first one's result. Other processes are kept apart by the store's lock file.
_pulling: dict[tuple[int, Path], asyncio.Future[Path]] = {}


async def pull(
    source: HubSource,
    models_root: Path,
    *,
    endpoint: str,
    token: str | None,
    progress: Progress | None = None,
    offline: bool = False,
    limits: HubLimits | None = None,
) -> Path:
    """The store folder of `source`, downloading it first if needed.

    A 40-hex revision whose store is complete returns at once with no request, which is how
    a host works offline. With `offline`, a missing store (or a branch or tag, which only the
    Hub can resolve) fails with `hf_offline_missing`. `progress(done, total)` is told the bytes
    of the download as they arrive."""
    if is_commit(source.revision):
        paths = StorePaths.of(models_root, source, source.revision)
        if paths.complete():
            return paths.store
    if offline:
        raise HfOfflineMissing(
            f"{source.repo}@{source.revision} is not in the model store under {models_root} and "
            "this host works offline; download it while online (pin a 40-hex commit), or deploy "
            "the model from a local folder"
        )
    async with HubClient(endpoint, token, limits) as client:
        commit = await client.resolve(source)
        paths = StorePaths.of(models_root, source, commit)
        key = (id(asyncio.get_running_loop()), paths.store)
        while (running := _pulling.get(key)) is not None:
            try:
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                if not running.cancelled():
                    raise  # this caller was cancelled
                # the caller that ran the download was cancelled: the next one takes it over
        future: asyncio.Future[Path] = asyncio.get_running_loop().create_future()
        _pulling[key] = future
        try:
            store = await _pull_commit(client, source, commit, paths, progress)
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # retrieved here, so a lone pull leaves no warning behind
            raise
        except BaseException:
            future.cancel()
            raise
        else:
            future.set_result(store)
            return store
        finally:
            del _pulling[key]


async def resolve(
    source: HubSource, *, endpoint: str, token: str | None, limits: HubLimits | None = None
) -> str:
    """The 40-hex commit `source.revision` names (no request when it is one already): the
    explicit "pin" step for a branch or tag."""
    async with HubClient(endpoint, token, limits) as client:
        return await client.resolve(source)


async def listed_weights(
    source: HubSource,
    commit: str,
    *,
    endpoint: str,
    token: str | None,
    limits: HubLimits | None = None,
) -> int | None:
    """The size of the weights `source` selects at `commit`, as the Hub's file listing says
    (nothing is downloaded); None when it selects no weights."""
    async with HubClient(endpoint, token, limits) as client:
        plan = plan_from_tree(source, commit, await client.tree(source, commit))
    return weights_of((file.path, file.size) for file in plan.files)
