from __future__ import annotations

from pathlib import Path

import pytest

from capyctl_hostd.logwriter import RotatingLog, redact

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
