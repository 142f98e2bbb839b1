"""A folder the test processes of one run share: made once, by the first to ask, while the
others wait on its lock; removed by the last of them to exit. A run without workers
(pytest-xdist) has it to itself."""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from support import short_dir


def shared_folder(name: str, make: Callable[[Path], None]) -> Path:
    """This run's folder `name`, filled by `make` once for the whole run."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        folder = short_dir(name)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        make(folder)
        return folder
    folder = Path(tempfile.gettempdir()) / f"{name}-{run}"
    folder.mkdir(exist_ok=True)
    # Each process of the run holds the users' lock shared while it lives.
    users = (folder.parent / f"{folder.name}.users").open("a")
    fcntl.flock(users, fcntl.LOCK_SH)
    atexit.register(_leave, folder, users)
    with (folder.parent / f"{folder.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder / ".made"
        if not done.exists():
            make(folder)
            done.touch()
    return folder


def _leave(folder: Path, users: IO[str]) -> None:
    """Remove the folder if no other process of the run still holds the users' lock."""
    try:
        fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        users.close()
        return
    shutil.rmtree(folder, ignore_errors=True)
    for suffix in (".users", ".lock"):
        (folder.parent / f"{folder.name}{suffix}").unlink(missing_ok=True)
    users.close()
