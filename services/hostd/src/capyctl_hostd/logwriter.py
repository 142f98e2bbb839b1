"""`python -m capyctl_hostd.logwriter FILE`: an engine's log, redacted and rotated.
`python -m capyctl_hostd.logwriter --memory SOCKET`: its last lines in this process's memory
only (retention: zero), each connection to the unix socket SOCKET (owner-only) answered with
all of them.

The engine writes to this process's stdin. It runs in a session of its own, so it outlives a
restart of hostd, and ends when the engine closes its output. Secrets to redact come in the
CAPYCTL_REDACT variable, one per line.

A full disk loses lines, never the engine: the writer keeps reading (an engine whose output
stopped being read would block, and one whose pipe closed would die), says so once on its
stderr, and when writing works again notes in the log how many lines were lost.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import socket
import sys
import threading
from pathlib import Path
from typing import BinaryIO

MAX_BYTES = 16 << 20
BACKUPS = 3
REDACTED = "<redacted>"

_PATTERNS = [
    re.compile(r"(?i)(authorization:\s*bearer\s+)\S+"),
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(
        r"(?i)((?:api_key|admin_api_key|token|password|secret)['\"]?\s*[=:]\s*['\"]?)[^\s'\",)]+"
    ),
    re.compile(r"()hf_[A-Za-z0-9]{20,}"),
    re.compile(r"(://[^/\s:@]+:)[^@\s/]+(?=@)"),
]


def redact(line: str, secrets: list[str]) -> str:
    for secret in secrets:
        line = line.replace(secret, REDACTED)
    for pattern in _PATTERNS:
        line = pattern.sub(lambda m: f"{m[1]}{REDACTED}", line)
    return line


class RotatingLog:
    """`path`, rotated to `path.1` .. `path.<BACKUPS>` past MAX_BYTES; owner-only."""

    def __init__(self, path: Path, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.handle = self._open()
        self.dropped = 0
        self.why = ""

    def _open(self) -> BinaryIO:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return os.fdopen(fd, "ab")

    def write(self, data: bytes) -> None:
        """Append `data`; a line the disk has no room for is counted, not raised."""
        try:
            if self.dropped:
                self._append(f"capyctl: {self.dropped} lines lost ({self.why})\n".encode())
                self.dropped = 0
            self._append(data)
        except OSError as exc:
            if not self.dropped:
                print(f"capyctl: {self.path}: {exc.strerror}; dropping lines", file=sys.stderr)
            self.dropped += 1
            self.why = exc.strerror or str(exc)
            self.handle = self._reopen()

    def _append(self, data: bytes) -> None:
        self.handle.write(data)
        self.handle.flush()
        if self.handle.tell() >= self.max_bytes:
            self.rotate()

    def _reopen(self) -> BinaryIO:
        """A fresh handle: the old one holds the bytes it could not write in its buffer."""
        with contextlib.suppress(OSError):  # the buffered bytes are lost with the line
            self.handle.close()
        return self._open()

    def rotate(self) -> None:
        self.handle.close()
        for index in range(BACKUPS - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{index + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self.handle = self._open()

    def close(self) -> None:
        self.handle.close()


# The lines a log kept in memory holds, the oldest dropped first.
MEMORY_LINES = 2000


class MemoryLog:
    """The last MEMORY_LINES lines, in memory only, served whole to each connection on a
    unix socket that only the owner may open."""

    def __init__(self, path: Path, lines: int = MEMORY_LINES) -> None:
        self.path = path
        self.lines: collections.deque[bytes] = collections.deque(maxlen=lines)
        self.lock = threading.Lock()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        umask = os.umask(0o177)
        try:
            self.server.bind(str(path))
        finally:
            os.umask(umask)
        self.server.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def write(self, data: bytes) -> None:
        with self.lock:
            self.lines.append(data)

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return  # closed
            with connection, contextlib.suppress(OSError):
                with self.lock:
                    held = b"".join(self.lines)
                connection.sendall(held)

    def close(self) -> None:
        self.server.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def main() -> None:
    secrets = [s for s in os.environ.get("CAPYCTL_REDACT", "").splitlines() if s]
    log: RotatingLog | MemoryLog
    if sys.argv[1] == "--memory":
        log = MemoryLog(Path(sys.argv[2]))
    else:
        path = Path(sys.argv[1])
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        log = RotatingLog(path)
    for raw in sys.stdin.buffer:
        text = raw.decode("utf-8", "replace").rstrip("\n")
        log.write((redact(text, secrets) + "\n").encode())
    log.close()


if __name__ == "__main__":
    main()
