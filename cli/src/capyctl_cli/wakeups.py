"""What wakes the launcher's waits: a pipe written by a signal or an exit (`Wake`), and inotify
on folders, so a wait sleeps until something happens instead of looking every few hundred
milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import select
from pathlib import Path


class Wake:
    """A pipe the launcher's main loop waits on (with any other descriptors): written by a
    signal (`signal.set_wakeup_fd`) and when supervisord exits, so the loop sleeps until
    something happens instead of looking every few hundred milliseconds."""

    def __init__(self) -> None:
        self.reader, self.writer = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def wait(self, fds: list[int], timeout: float | None) -> None:
        """Until the pipe or one of `fds` is readable, or `timeout` seconds passed."""
        poller = select.poll()
        for fd in [self.reader, *fds]:
            poller.register(fd, select.POLLIN)
        poller.poll(None if timeout is None or math.isinf(timeout) else timeout * 1000)
        with contextlib.suppress(BlockingIOError):
            while os.read(self.reader, 512):
                pass

    def set(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.writer, b"x")

    def close(self) -> None:
        os.close(self.reader)
        os.close(self.writer)


# inotify(7): a file in the folder was written, created, or renamed into it.
_IN_MODIFY, _IN_CREATE, _IN_MOVED_TO = 0x2, 0x100, 0x80


def inotify(folders: set[Path]) -> int | None:
    """An inotify descriptor watching `folders`, or None where the kernel or libc has none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
    except (OSError, AttributeError):
        return None
    if fd < 0:
        return None
    mask = _IN_MODIFY | _IN_CREATE | _IN_MOVED_TO
    for folder in folders:
        if libc.inotify_add_watch(fd, os.fsencode(folder), mask) < 0:
            os.close(fd)
            return None
    return fd


def drain(fd: int) -> None:
    """Read the events waiting on an inotify descriptor: which file changed is not needed."""
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 65536):
            pass
