"""SGLang's scheduler and detokenizer, as children of the simulated HTTP server (only with the
`scheduler_dies` fault, which needs them).

python -m enginesim.sglang_children scheduler LOADS_SHM DIE_AFTER CODE MSG
python -m enginesim.sglang_children detokenizer

Both write their Prometheus multiprocess file into PROMETHEUS_MULTIPROC_DIR every 0.1 s, as
SGLang's children do on each metric update; when that folder is gone each write prints the
FileNotFoundError SGLang's children print then. The scheduler makes the load-snapshot segment
`/dev/shm/sglang_loads_<name>_<digest>.shm` and a `psm_<hex>` segment (no PID in either
name), holds them mapped, and after DIE_AFTER seconds dies with MSG and CODE, leaving them. On
SIGTERM a child goes on writing for a second (its own shutdown) and exits.
"""

from __future__ import annotations

import mmap
import os
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

SHM = Path("/dev/shm")  # noqa: S108 - SGLang's segments live there
WRITE_EVERY_S = 0.1
LINGER_S = 1.0


class _Life:
    """When SIGTERM came (None while running)."""

    stopping_at: float | None = None

    def stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping_at = time.monotonic()

    def over(self) -> bool:
        return self.stopping_at is not None and time.monotonic() - self.stopping_at >= LINGER_S


def _write_metrics() -> None:
    path = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")) / f"gauge_all_{os.getpid()}.db"
    try:
        with path.open("ab") as handle:
            handle.write(b"\0" * 8)
    except FileNotFoundError:
        print(f"FileNotFoundError: [Errno 2] No such file or directory: '{path}'", flush=True)


def _segment(name: str) -> mmap.mmap:
    fd = os.open(SHM / name, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    return mmap.mmap(fd, 4096)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    life = _Life()
    signal.signal(signal.SIGTERM, life.stop)
    held: list[mmap.mmap] = []
    death: tuple[float, int, str] | None = None
    if args[0] == "scheduler":
        held += [_segment(args[1]), _segment(f"psm_{secrets.token_hex(4)}")]
        death = (time.monotonic() + float(args[2]), int(args[3]), args[4])
    while not life.over():
        _write_metrics()
        if death is not None and time.monotonic() >= death[0] and life.stopping_at is None:
            print(f"Scheduler hit an exception: {death[2]}", flush=True)
            os._exit(death[1])
        time.sleep(WRITE_EVERY_S)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
