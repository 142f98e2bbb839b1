"""The state dir's role lock: one role at a time on a state dir, and a way for any command
to tell whether one runs there now."""

from __future__ import annotations

import fcntl
import os

from capycommon.errors import StateDirInUse
from capycommon.paths import StatePaths, ensure_private_dir
from capyctl_cli import record


def acquire_lock(paths: StatePaths) -> int:
    """Hold the state dir's role lock, or refuse naming the role that holds it."""
    ensure_private_dir(paths.root)
    ensure_private_dir(paths.run_dir)
    fd = os.open(paths.role_lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _describe_holder(paths)
        raise StateDirInUse(
            f"{holder} already runs on the state dir {paths.root}; stop it first, or start "
            "this one with another --state-dir"
        ) from None
    return fd


def lock_is_held(paths: StatePaths) -> bool:
    """Whether a role holds the state dir's lock right now (checked without keeping it)."""
    try:
        fd = os.open(paths.role_lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _describe_holder(paths: StatePaths) -> str:
    found = record.read(paths)
    return "another role" if found is None else f"the {found.role} role (pid {found.pid})"
