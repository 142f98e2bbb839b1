"""A role that cannot trust its credentials or its settings refuses to start."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ports import free_port
from support import capyctl, clean_env, processes_mentioning, short_dir

GOOD_KEY = "k" * 43
GOOD_TOKEN = "t" * 43


@pytest.fixture
def state() -> Iterator[Path]:
    folder = short_dir() / "state"
    (folder / "identity").mkdir(parents=True, mode=0o700)
    folder.chmod(0o700)
    yield folder
    shutil.rmtree(folder.parent, ignore_errors=True)


def _write(text: str, mode: int = 0o600) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.write_text(text)
        path.chmod(mode)

    return make


def _as_directory(path: Path) -> None:
    path.mkdir(mode=0o700)


def _dangling(path: Path) -> None:
    path.symlink_to(path.parent / "nowhere")


GOOD = f"api_key: {GOOD_KEY}\nadmin_token: {GOOD_TOKEN}\n"

CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "group-readable": (
        _write(GOOD, 0o640),
        "is readable or writable by group or others (mode 0640)",
    ),
    "world-readable": (
        _write(GOOD, 0o604),
        "is readable or writable by group or others (mode 0604)",
    ),
    "unreadable": (_as_directory, "cannot read"),
    "dangling link": (_dangling, "does not exist"),
    "not yaml": (
        _write("api_key: [unclosed\n"),
        "must hold exactly the keys api_key and admin_token",
    ),
    "missing token": (_write(f"api_key: {GOOD_KEY}\n"), "must hold exactly the keys"),
    "extra key": (_write(GOOD + "other: x\n"), "must hold exactly the keys"),
    "short key": (_write(f"api_key: short\nadmin_token: {GOOD_TOKEN}\n"), "api_key in"),
    "equal values": (_write(f"api_key: {GOOD_KEY}\nadmin_token: {GOOD_KEY}\n"), "are equal"),
}


@pytest.mark.parametrize("case", CASES)
def test_untrusted_credentials_refuse_the_start(state: Path, case: str) -> None:
    make, expected = CASES[case]
    credentials = state / "identity" / "credentials"
    make(credentials)
    listen = f"127.0.0.1:{free_port()}"
    result = capyctl("start", "standalone", "--state-dir", str(state), "--listen", listen)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error [credentials_unusable]: ")
    assert str(credentials) in result.stderr
    assert expected in result.stderr
    assert result.stderr.count("\n") == 1, "one line, no traceback"
    assert processes_mentioning(str(state)) == []


def test_debug_shows_the_traceback(state: Path) -> None:
    (state / "identity" / "credentials").write_text("nonsense")
    (state / "identity" / "credentials").chmod(0o600)
    result = capyctl("--debug", "start", "standalone", "--state-dir", str(state))
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("error [credentials_unusable]")


def test_first_start_creates_owner_only_credentials(state: Path) -> None:
    shutil.rmtree(state / "identity")
    result = capyctl("init", "standalone", "--state-dir", str(state), "--json")
    assert result.returncode == 0, result.stderr
    identity = state / "identity"
    assert identity.stat().st_mode & 0o777 == 0o700
    credentials = identity / "credentials"
    assert credentials.stat().st_mode & 0o777 == 0o600
    document = state / "config" / "standalone.yaml"
    assert document.stat().st_mode & 0o777 == 0o600
    before = credentials.read_text()
    assert capyctl("init", "standalone", "--state-dir", str(state)).returncode == 0
    assert credentials.read_text() == before, "a second start keeps the credentials"


def test_a_malformed_setting_refuses_the_start_naming_its_origin(state: Path) -> None:
    env = clean_env(CAPYCTL_INFERENCE_ADDR="nowhere")
    result = capyctl("start", "standalone", "--state-dir", str(state), env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("error [invalid_config]: CAPYCTL_INFERENCE_ADDR sets ")
    assert "'nowhere' is not ADDR:PORT" in result.stderr

    flagged = capyctl(
        "start", "standalone", "--state-dir", str(state), "--management-listen", "0.0.0.0:7443"
    )
    assert flagged.returncode == 2
    assert flagged.stderr.startswith("error [invalid_config]: --management-listen sets ")
    assert "not a loopback address" in flagged.stderr
    assert processes_mentioning(str(state)) == []


def test_a_missing_explicit_document_is_never_generated(state: Path) -> None:
    missing = state / "mine.yaml"
    result = capyctl("start", "standalone", "--state-dir", str(state), "--config", str(missing))
    assert result.returncode == 2
    assert f"--config names {missing}, which is not a file" in result.stderr
    assert not missing.exists()


def test_a_state_dir_others_can_write_is_refused(state: Path) -> None:
    os.chmod(state, 0o777)
    result = capyctl("start", "standalone", "--state-dir", str(state))
    assert result.returncode == 2
    assert f"{state} is writable by group or others (mode 0777)" in result.stderr


def test_version() -> None:
    result = capyctl("--version")
    assert result.returncode == 0
    assert result.stdout == "capyctl 0.1.0\n"
