"""How this machine reaches the Hub: the endpoint, the token, and whether it works offline.

The token comes from `CAPYCTL_HF_TOKEN`, else from the file `hf-token` in the state folder,
which only its owner may read; never from a flag (flags show in `ps`), and never from the
user's own Hugging Face cache.
"""

from __future__ import annotations

import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from capycommon.errors import InvalidConfig
from capycommon.hub.source import endpoint_from

TOKEN_FILE = "hf-token"  # noqa: S105 (a file name, not a secret)
TOKEN_ENV = "CAPYCTL_HF_TOKEN"  # noqa: S105 (a variable name)
_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class HubAccess:
    endpoint: str
    token: str | None
    offline: bool

    def __repr__(self) -> str:  # the token never reaches a log through a repr
        return f"HubAccess(endpoint={self.endpoint!r}, offline={self.offline})"


def read_token(state_dir: Path, env: Mapping[str, str]) -> str | None:
    """The Hub token, or None without one; a token file others can read is refused."""
    value = env.get(TOKEN_ENV, "").strip()
    if value:
        return value
    path = state_dir / TOKEN_FILE
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    if stat.S_IMODE(mode) & 0o077:
        raise InvalidConfig(
            f"{path} is readable by others (mode {stat.S_IMODE(mode):04o}); a Hub token file "
            f"must be the owner's alone: chmod 600 {path}"
        )
    return path.read_text().strip() or None


def hub_access(state_dir: Path, env: Mapping[str, str]) -> HubAccess:
    return HubAccess(
        endpoint=endpoint_from(env),
        token=read_token(state_dir, env),
        offline=env.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE,
    )
