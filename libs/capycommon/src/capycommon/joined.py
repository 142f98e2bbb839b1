"""What a host keeps once it joined a server: its id, where the server is, and its Redis
user. `capyctl join host` writes it (owner-only) beside the host's key and certificate;
`capyctl start host` reads it, so a joined host needs no `redis.url`."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, ValidationError

from capycommon.domain.replication import Topology
from capycommon.domain.strict import Strict
from capycommon.errors import CredentialsUnusable
from capycommon.paths import StatePaths, ensure_private_dir, read_private, write_atomic


class Joined(Strict):
    host_name: str
    host_id: str
    server_version: str
    bootstrap_address: str
    redis_address: str
    redis_user: str
    redis_password: str = Field(repr=False)
    joined_at: float
    # Replicated servers: the Sentinels that say which server's Redis is the primary, as the
    # server last published them (`capycommon.state.keys.topology`); None for one server.
    topology: Topology | None = None


def write(paths: StatePaths, joined: Joined) -> None:
    ensure_private_dir(paths.identity_dir)
    write_atomic(paths.joined, joined.model_dump_json(indent=2), mode=0o600)


def read(paths: StatePaths) -> Joined | None:
    """The host's enrollment; None when it never joined. A file that cannot be trusted
    refuses: it holds the host's Redis password."""
    file = paths.joined
    if not file.exists() and not file.is_symlink():
        return None
    again = (
        "join again: `capyctl invite host NAME --recover` on the server, then "
        "`capyctl join host --join-file FILE --recover` here"
    )
    text = read_private(file, missing=again, fix=again)
    try:
        return Joined.model_validate(json.loads(text))
    except (ValueError, ValidationError):
        raise CredentialsUnusable(f"{file} is damaged; {again}") from None


def missing_files(paths: StatePaths) -> list[Path]:
    """The identity files a joined host cannot connect without, that are missing."""
    needed = (paths.host_certificate, paths.joined_authority)
    return [path for path in needed if not path.exists()]
