"""/dev/shm segments a launch leaves behind are removed once no process holds them."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from capyctl_hostd import procs
from support import wait_for

HOLDER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
region = mmap.mmap(fd, 4096)
print("mapped", flush=True)
sys.stdin.read()
"""


@contextmanager
def holder_of(segment: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process that maps `segment` (making it) until it is killed, on leaving the `with`."""
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(segment)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline() == b"mapped\n"
            yield holder
        finally:
            holder.kill()


def test_a_held_segment_stays_and_a_free_one_goes() -> None:
    with subprocess.Popen(["true"]) as engine:  # the launch whose segment is left behind
        engine.wait()
    name = f"multi_tokenizer_args_{engine.pid}"
    segment = Path("/dev/shm") / name
    with holder_of(segment):
        assert procs.shm_segments_of({engine.pid}) == [name]
        assert procs.remove_segments([name]) == [], "a segment a process maps is left alone"
        assert segment.exists()
    try:
        wait_for(lambda: procs.remove_segments([name]) == [name], timeout=5, what="the removal")
        assert not segment.exists()
    finally:
        segment.unlink(missing_ok=True)


def test_segments_are_found_by_who_holds_them_not_by_name() -> None:
    name = f"sglang_loads_tmp{secrets.token_hex(4)}_{secrets.token_hex(4)}.shm"
    segment = Path("/dev/shm") / name
    try:
        with holder_of(segment) as holder:
            assert name in procs.shm_held_by([holder.pid])
            assert procs.shm_segments_of({holder.pid}) == [], "no PID in its name"
    finally:
        segment.unlink(missing_ok=True)
