"""The progress bar `deploy model --wait` and `model pull` show on stderr while a model
downloads."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from capycommon.management import Download


class DownloadBar:
    """A bar that appears with the first download figures shown to it, and follows them."""

    def __init__(self) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._task: TaskID | None = None

    def __enter__(self) -> DownloadBar:
        return self

    def __exit__(self, *_: object) -> None:
        if self._task is not None:
            self._progress.stop()

    def show(self, download: Download | None) -> None:
        if download is None:
            return
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task(
                f"{download.repo}@{download.commit[:12]} on {download.host}",
                total=download.total_bytes,
            )
        self._progress.update(self._task, completed=download.done_bytes)
