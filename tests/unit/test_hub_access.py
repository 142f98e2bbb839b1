"""The Hub token: from CAPYCTL_HF_TOKEN, else the state folder's hf-token, the owner's alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from capycommon.errors import InvalidConfig
from capycommon.hub import hub_access, read_token


def test_the_variable_comes_first_then_the_file(tmp_path: Path) -> None:
    assert read_token(tmp_path, {}) is None
    token = tmp_path / "hf-token"
    token.write_text("hf_from_file\n")
    token.chmod(0o600)
    assert read_token(tmp_path, {}) == "hf_from_file"
    assert read_token(tmp_path, {"CAPYCTL_HF_TOKEN": "hf_from_env"}) == "hf_from_env"


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "hf-token"
    token.write_text("hf_secret")
    token.chmod(0o644)
    with pytest.raises(InvalidConfig) as caught:
        read_token(tmp_path, {})
    assert caught.value.message == (
        f"{token} is readable by others (mode 0644); a Hub token file must be the owner's "
        f"alone: chmod 600 {token}"
    )
    assert "hf_secret" not in caught.value.message


def test_access_names_the_endpoint_and_offline_and_hides_the_token(tmp_path: Path) -> None:
    env = {"CAPYCTL_HF_ENDPOINT": "http://127.0.0.1:9/", "CAPYCTL_HF_TOKEN": "hf_x"}
    access = hub_access(tmp_path, {**env, "HF_HUB_OFFLINE": "1"})
    assert (access.endpoint, access.token, access.offline) == ("http://127.0.0.1:9", "hf_x", True)
    assert "hf_x" not in repr(access)
    assert not hub_access(tmp_path, env).offline
