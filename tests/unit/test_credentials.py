from __future__ import annotations

from pathlib import Path

import pytest

from capycommon import credentials
from capycommon.errors import CredentialsUnusable


def test_generated_credentials_are_distinct_256_bit_values(tmp_path: Path) -> None:
    path = tmp_path / "identity" / "credentials"
    made = credentials.ensure(path)
    assert made.api_key != made.admin_token
    for value in (made.api_key, made.admin_token):
        assert len(value) == 43  # 32 bytes, URL-safe base64 without padding
        assert credentials.TOKEN_PATTERN.fullmatch(value)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert credentials.ensure(path) == made
    assert "api_key" not in repr(made) or made.api_key not in repr(made)


def test_a_readable_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "identity" / "credentials"
    credentials.ensure(path)
    path.chmod(0o644)
    before = path.read_text()
    with pytest.raises(CredentialsUnusable, match=r"mode 0644\); run `chmod 600 "):
        credentials.ensure(path)
    assert path.read_text() == before
