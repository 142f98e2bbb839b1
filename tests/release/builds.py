"""Releases as a user gets them, for the release tests: scripts/release builds the tree under
a version, signed with a throwaway key made here (the release key itself never is), a
loopback HTTP server serves the release folders, and the installer published with them
installs into a temporary prefix."""

from __future__ import annotations

import http.server
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from capycommon.version import __version__
from support import clean_env

ROOT = Path(__file__).resolve().parents[2]
ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}[
    platform.machine().lower()
]
MAJOR, MINOR, PATCH = (int(part) for part in __version__.split(".")[:3])
OLD = f"{MAJOR}.{MINOR}.{PATCH}"
NEW = f"{MAJOR}.{MINOR}.{PATCH + 1}"


@dataclass(frozen=True)
class Releases:
    """Releases `v<OLD>/` and `v<NEW>/` (and `latest/`, the newer) in `folder`, served at
    `url` on loopback, signed with the private key at `key`."""

    folder: Path
    url: str
    key: Path

    @property
    def installer(self) -> Path:
        """The install.sh published with the releases: it carries the key's public half."""
        return self.folder / "latest" / "install.sh"


class Quiet(http.server.SimpleHTTPRequestHandler):
    """Serves a folder, logging nothing."""

    def log_message(self, format: str, *args: object) -> None:
        return


def signing_key(folder: Path, name: str) -> Path:
    """A new Ed25519 key pair without a passphrase, `folder/name` and `folder/name.pub`."""
    folder.mkdir(parents=True, exist_ok=True)
    key = folder / name
    argv = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)]
    subprocess.run(argv, check=True, timeout=30)
    return key


def public_half(key: Path) -> str:
    """The key's type and base64, as the installer carries them."""
    return " ".join(key.with_suffix(".pub").read_text().split()[:2])


def release(
    out: Path, key: Path | None, version: str = OLD, platforms: str = ARCH, binary: bool = False
) -> subprocess.CompletedProcess[str]:
    """scripts/release of the tree into `out`, signed with `key` (none: not given at all);
    with the self-contained executable of this machine when `binary` (a minute more)."""
    env = {
        "CAPYCTL_RELEASE_BINARY": "1" if binary else "0",
        **{k: v for k, v in os.environ.items() if k != "CAPYCTL_RELEASE_SIGNING_KEY"},
        "CAPYCTL_RELEASE_VERSION": version,
        "CAPYCTL_RELEASE_PLATFORMS": platforms,
        "CAPYCTL_RELEASE_PYTHONS": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    signing = [] if key is None else ["--signing-key", str(key)]
    return subprocess.run(
        [str(ROOT / "scripts" / "release"), "--out", str(out), *signing],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )


def build(version: str, out: Path, key: Path, platforms: str = ARCH, binary: bool = False) -> None:
    result = release(out, key, version, platforms, binary)
    assert result.returncode == 0, result.stdout + result.stderr


def install(releases: Releases, *args: str, prefix: Path) -> subprocess.CompletedProcess[str]:
    """The published installer with `args`, into `prefix`."""
    return subprocess.run(
        ["sh", str(releases.installer), "--prefix", str(prefix), *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=300,
        check=False,
    )
