"""The inference API key and the management admin token of a role.

They live in `<state>/identity/credentials`, a YAML file with `api_key` and `admin_token`,
owner-only. A file that cannot be trusted refuses the start: there is no fallback key.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from capycommon.errors import CredentialsUnusable, InvalidConfig
from capycommon.paths import ensure_private_dir, read_private, write_atomic
from capycommon.yamldoc import parse_yaml

TOKEN_PATTERN = re.compile(r"[A-Za-z0-9._~+/=-]{32,256}")
FIELDS = ("api_key", "admin_token")


@dataclass(frozen=True)
class Credentials:
    api_key: str = field(repr=False)
    admin_token: str = field(repr=False)


def generate() -> Credentials:
    """Two distinct random 256-bit values."""
    return Credentials(api_key=secrets.token_urlsafe(32), admin_token=secrets.token_urlsafe(32))


def ensure(path: Path) -> Credentials:
    """Load the credentials at `path`, generating them on first start."""
    ensure_private_dir(path.parent)
    if not path.exists() and not path.is_symlink():
        write(path, generate())
    return load(path)


def write(path: Path, found: Credentials) -> None:
    """Write `found` to `path`, owner-only: at the first start, or from a peer file (every
    replicated server takes the same keys)."""
    text = "".join(f"{name}: {getattr(found, name)}\n" for name in FIELDS)
    write_atomic(path, text, mode=0o600)


def load(path: Path) -> Credentials:
    """Read and check the credentials file; any doubt refuses."""
    regenerate = f"delete {path} to generate new credentials, or restore a good copy"
    text = read_private(path, missing="start the role once to create it", fix=regenerate)
    try:
        data = parse_yaml(text, str(path))
    except InvalidConfig:
        data = None
    if not isinstance(data, dict) or set(data) != set(FIELDS):
        raise CredentialsUnusable(
            f"{path} must hold exactly the keys api_key and admin_token; {regenerate}"
        )
    for name in FIELDS:
        value = data[name]
        if not isinstance(value, str) or not TOKEN_PATTERN.fullmatch(value):
            raise CredentialsUnusable(
                f"{name} in {path} must be 32-256 characters of [A-Za-z0-9._~+/=-]; {regenerate}"
            )
    if data["api_key"] == data["admin_token"]:
        raise CredentialsUnusable(f"api_key and admin_token in {path} are equal; {regenerate}")
    return Credentials(api_key=data["api_key"], admin_token=data["admin_token"])
