"""A role starts on a state dir only from the release line that started it or a newer one:
the state dir keeps the newest release that started it, and a start only raises it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from capycommon.errors import InvalidConfig, StateDirNewer
from capycommon.paths import StatePaths
from capyctl_cli.stateversion import admit
from support import CAPYCTL, clean_env


def test_the_first_start_keeps_its_release(tmp_path: Path) -> None:
    paths = StatePaths(tmp_path)
    admit(paths, "0.1.0")
    assert paths.release.read_text() == "0.1.0\n"


def test_a_start_only_raises_the_release_kept(tmp_path: Path) -> None:
    paths = StatePaths(tmp_path)
    admit(paths, "0.1.1")
    admit(paths, "0.1.0")  # a rollback within the release line
    assert paths.release.read_text() == "0.1.1\n"
    admit(paths, "0.2.0")  # an upgrade to the next line
    assert paths.release.read_text() == "0.2.0\n"


def test_a_newer_release_line_refuses_naming_both_versions(tmp_path: Path) -> None:
    paths = StatePaths(tmp_path)
    admit(paths, "0.2.3")
    with pytest.raises(StateDirNewer) as refused:
        admit(paths, "0.1.9")
    assert "CapyCTL 0.2.3" in refused.value.message
    assert "CapyCTL 0.1.9" in refused.value.message
    assert "install.sh --version v0.2.3" in refused.value.message
    assert refused.value.exit_code == 5
    assert paths.release.read_text() == "0.2.3\n"


def test_a_record_that_is_not_a_version_is_refused_naming_the_file(tmp_path: Path) -> None:
    paths = StatePaths(tmp_path)
    paths.release.write_text("yesterday\n")
    with pytest.raises(InvalidConfig, match=str(paths.release)):
        admit(paths, "0.1.0")


def test_capyctl_start_refuses_a_state_dir_of_a_newer_line(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "release").write_text("9.0.0\n")
    result = subprocess.run(
        [CAPYCTL, "start", "standalone", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
        check=False,
    )
    assert result.returncode == 5, result.stderr
    assert "error [state_dir_newer]" in result.stderr
    assert "CapyCTL 9.0.0" in result.stderr
    assert not (state / "redis").exists(), "nothing was prepared"
