from __future__ import annotations

from pathlib import Path

import pytest

from capyctl_hostd.logwriter import RotatingLog, redact
from support import run_python

KEY = "s3cr3t-per-launch-key-abcdefghijklmnop"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (f"server_args api_key='{KEY}' port=8100", "server_args api_key='<redacted>' port=8100"),
        ("Authorization: Bearer abcdefgh12345678", "Authorization: Bearer <redacted>"),
        ("token=hf_abcdefghijklmnopqrstuvwxyz123", "token=<redacted>"),
        (
            "fetching https://user:pa55word@example.com/x",
            "fetching https://user:<redacted>@example.com/x",
        ),
        ("nothing to hide here", "nothing to hide here"),
    ],
)
def test_redaction(line: str, expected: str) -> None:
    assert redact(line, [KEY]) == expected


def test_the_launch_key_is_redacted_wherever_it_appears() -> None:
    assert KEY not in redact(f"listening with key {KEY} on 127.0.0.1", [KEY])


def test_rotation_keeps_three_owner_only_files(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    log = RotatingLog(path, max_bytes=100)
    for index in range(50):
        log.write(f"line {index:03d} {'x' * 20}\n".encode())
    log.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["engine.log", "engine.log.1", "engine.log.2", "engine.log.3"]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in tmp_path.iterdir())
    assert "line 049" in path.read_text() or "line 049" in (tmp_path / "engine.log.1").read_text()


def test_a_full_disk_loses_lines_not_the_engine_and_says_how_many(tmp_path: Path) -> None:
    log = RotatingLog(Path("/dev/full"))  # every write: ENOSPC
    log.write(b"a\n")
    log.write(b"b\n")
    log.path = tmp_path / "engine.log"  # room again
    log.write(b"c\n")  # still on the full handle: lost, and the writer moves on
    log.write(b"d\n")
    log.close()
    lost = "capyctl: 3 lines lost (No space left on device)"
    assert (tmp_path / "engine.log").read_text() == f"{lost}\nd\n"


def test_the_writer_reads_all_its_input_while_the_disk_is_full() -> None:
    lines = "".join(f"line {n}\n" for n in range(2000))
    found = run_python("-m", "capyctl_hostd.logwriter", "/dev/full", stdin=lines, timeout=30)
    assert found.returncode == 0, found.stderr
    assert found.stderr == "capyctl: /dev/full: No space left on device; dropping lines\n"
