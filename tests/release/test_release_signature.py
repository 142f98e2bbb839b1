"""A release's SHA256SUMS is signed with the release key, whose public half the published
installer carries: a release that key signed installs, and the installer refuses a
SHA256SUMS changed after signing, a release without its signature, one signed by another key,
and a version that is not X.Y.Z (asked for, or named by a signed SHA256SUMS) before it is part
of a URL or a path. The release key never enters the repository: the build takes its path."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from release.builds import (
    ARCH,
    OLD,
    ROOT,
    Releases,
    install,
    public_half,
    release,
    signing_key,
)
from support import clean_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

EXECUTABLE = f"capyctl-{OLD}-linux-{ARCH}"  # the self-contained one, which install.sh prefers


def test_the_published_installer_carries_the_key_that_signed_the_release(
    releases: Releases, tmp_path: Path
) -> None:
    folder = releases.folder / f"v{OLD}"
    assert f'RELEASE_SIGNER="{public_half(releases.key)}"\n' in (folder / "install.sh").read_text()
    assert 'RELEASE_SIGNER=""\n' in (ROOT / "install.sh").read_text(), "none in the repository"
    signers = tmp_path / "allowed_signers"
    signers.write_text(
        f'capyctl-release namespaces="capyctl-release" {public_half(releases.key)}\n'
    )
    verify = ["ssh-keygen", "-Y", "verify", "-I", "capyctl-release", "-n", "capyctl-release"]
    verify += ["-f", str(signers), "-s", str(folder / "SHA256SUMS.sig")]
    with (folder / "SHA256SUMS").open("rb") as sums:
        checked = subprocess.run(verify, stdin=sums, capture_output=True, timeout=30, check=False)
    assert checked.returncode == 0, checked.stderr


def test_a_build_without_a_signing_key_is_refused_before_it_starts(tmp_path: Path) -> None:
    refused = release(tmp_path / "out", None)
    assert refused.returncode == 2
    assert "a release is signed: pass --signing-key PATH" in refused.stderr
    (tmp_path / "not-a-key").write_text("hello\n")
    refused = release(tmp_path / "out", tmp_path / "not-a-key")
    assert refused.returncode == 2
    assert f"{tmp_path / 'not-a-key'} is not an OpenSSH private key" in refused.stderr
    assert not (tmp_path / "out").exists()


def test_a_release_its_key_signed_installs(releases: Releases, tmp_path: Path) -> None:
    installed = install(releases, "--from", str(releases.folder / f"v{OLD}"), prefix=tmp_path)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert f"install: {tmp_path}/bin/capyctl is capyctl {OLD}" in installed.stdout
    assert (tmp_path / "bin" / "capyctl").resolve().name == EXECUTABLE
    pex = install(releases, "--from", str(releases.folder / f"v{OLD}"), "--pex", prefix=tmp_path)
    assert pex.returncode == 0, pex.stdout + pex.stderr
    assert (tmp_path / "bin" / "capyctl").resolve().parent.name == "bin", "the pex's venv"
    assert "/venv/" in str((tmp_path / "bin" / "capyctl").resolve())


def test_the_repository_installer_carries_no_key_and_installs_nothing(
    releases: Releases, tmp_path: Path
) -> None:
    argv = ["sh", str(ROOT / "install.sh"), "--prefix", str(tmp_path / "prefix")]
    argv += ["--from", str(releases.folder / f"v{OLD}")]
    refused = subprocess.run(
        argv, capture_output=True, text=True, env=clean_env(), timeout=60, check=False
    )
    assert refused.returncode == 1
    assert "install: this install.sh carries no release key" in refused.stderr
    assert not (tmp_path / "prefix").exists()


def _tamper(folder: Path, _: Path) -> None:
    """Another executable with its own hash in SHA256SUMS: what a hostile mirror serves."""
    executable = folder / EXECUTABLE
    data = bytearray(executable.read_bytes())
    data[len(data) // 2] ^= 0xFF
    executable.write_bytes(bytes(data))
    sums = folder / "SHA256SUMS"
    lines = [
        f"{hashlib.sha256(data).hexdigest()}  {EXECUTABLE}" if line.endswith(EXECUTABLE) else line
        for line in sums.read_text().splitlines()
    ]
    sums.write_text("\n".join(lines) + "\n")


def _sign(folder: Path, key: Path) -> None:
    (folder / "SHA256SUMS.sig").unlink()
    argv = ["ssh-keygen", "-q", "-Y", "sign", "-f", str(key), "-n", "capyctl-release"]
    subprocess.run([*argv, str(folder / "SHA256SUMS")], check=True, timeout=30)


def _other_key(folder: Path, _: Path) -> None:
    _sign(folder, signing_key(folder.parent / "keys", "other"))


def _unsigned(folder: Path, _: Path) -> None:
    (folder / "SHA256SUMS.sig").unlink()


def _escaping_version(folder: Path, key: Path) -> None:
    """A SHA256SUMS, signed by the release key, whose executable's version climbs out of
    <prefix>/lib/capyctl/ (and would be removed and written there)."""
    sums = folder / "SHA256SUMS"
    sums.write_text(sums.read_text().replace(EXECUTABLE, f"capyctl-{OLD}/../../x-linux-{ARCH}"))
    _sign(folder, key)


NOT_SIGNED = "is not signed by the CapyCTL release key; refusing the release"
REFUSED: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "a changed SHA256SUMS": (_tamper, f"SHA256SUMS of the release at {{folder}} {NOT_SIGNED}"),
    "no signature": (_unsigned, "the release at {folder} has no signature (SHA256SUMS.sig)"),
    "a signature by another key": (
        _other_key,
        f"SHA256SUMS of the release at {{folder}} {NOT_SIGNED}",
    ),
    "a version that is not X.Y.Z": (
        _escaping_version,
        f"the release at {{folder}} names its executable capyctl-{OLD}/../../x-linux-{ARCH},"
        " whose version is not X.Y.Z; refusing it",
    ),
}


@pytest.mark.parametrize(("damage", "said"), REFUSED.values(), ids=REFUSED.keys())
def test_a_release_the_key_did_not_sign_as_served_is_refused(
    releases: Releases, tmp_path: Path, damage: Callable[[Path, Path], None], said: str
) -> None:
    folder = tmp_path / "release"
    shutil.copytree(releases.folder / f"v{OLD}", folder)
    damage(folder, releases.key)
    prefix = tmp_path / "prefix"
    refused = install(releases, "--from", str(folder), prefix=prefix)
    assert refused.returncode == 1, refused.stdout
    assert f"install: {said.format(folder=folder)}" in refused.stderr
    assert not prefix.exists(), "nothing is installed"


@pytest.mark.parametrize("version", ["1.2.3/../../x", "../1.2.3", "1.2", "1.2.3-x", "1.2.3\nx"])
def test_a_version_asked_for_that_is_not_x_y_z_is_refused(
    releases: Releases, tmp_path: Path, version: str
) -> None:
    refused = install(releases, "--releases", releases.url, "--version", version, prefix=tmp_path)
    assert refused.returncode == 1
    assert f"install: --version {version} is not a CapyCTL version (X.Y.Z" in refused.stderr
    assert not (tmp_path / "lib").exists()
