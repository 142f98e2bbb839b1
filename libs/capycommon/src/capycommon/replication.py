"""What servers that replicate one state share: the passwords of the users their Redis and
Sentinels know each other by, and the topology every client finds the primary with.

The Redis users (in each server's ACL file, beside the control plane's and the hosts'):
- REPLICA_USER: what a replica logs in to its primary as (PSYNC, REPLCONF, PING only).
- SENTINEL_USER: what a Sentinel logs in to each Redis as (the commands Sentinel documents).

The Sentinel users (in each Sentinel's own configuration; its default user is off):
- PEER_USER: what the Sentinels log in to each other as, and the control plane's own (every
  right: `capyctl status` asks for the quorum).
- DISCOVER_USER: what every client asks for the primary as, hosts included: the read-only
  SENTINEL subcommands redis-py's discovery sends, nothing that changes a Sentinel.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from pathlib import Path

from pydantic import Field, ValidationError

from capycommon.domain.replication import Topology
from capycommon.domain.strict import Strict
from capycommon.errors import CredentialsUnusable, InvalidConfig
from capycommon.paths import ensure_private_dir, read_private, write_atomic
from capycommon.replsettings import SERVICE
from capycommon.settingvalues import check_dial_host

REPLICA_USER = "capyctl-replica"
SENTINEL_USER = "capyctl-sentinel"
PEER_USER = "capyctl-peer"
DISCOVER_USER = "capyctl-discover"

# What a replica sends its primary.
REPLICA_RULES = ("-@all", "+psync", "+replconf", "+ping")
# What a Sentinel sends each Redis it watches (Redis's Sentinel documentation).
SENTINEL_RULES = (
    "allchannels",
    "-@all",
    "+multi",
    "+slaveof",
    "+ping",
    "+exec",
    "+subscribe",
    "+config|rewrite",
    "+role",
    "+publish",
    "+info",
    "+client|setname",
    "+client|kill",
    "+script|kill",
)
# What a client asks a Sentinel to find the primary (redis-py's discovery, and redis-cli's).
DISCOVER_RULES = (
    "-@all",
    "+auth",
    "+hello",
    "+ping",
    "+client|setname",
    "+sentinel|get-master-addr-by-name",
    "+sentinel|masters",
    "+sentinel|master",
    "+sentinel|replicas",
    "+sentinel|slaves",
    "+sentinel|sentinels",
)

_PASSWORD = Field(min_length=32, max_length=256, pattern=r"^[A-Za-z0-9_-]+$", repr=False)


class Secrets(Strict):
    """The replication users' passwords, the same on every server."""

    replica: str = _PASSWORD
    sentinel: str = _PASSWORD
    peer: str = _PASSWORD
    discover: str = _PASSWORD

    @classmethod
    def generate(cls) -> Secrets:
        return cls(**{name: secrets.token_urlsafe(32) for name in cls.model_fields})


def ensure_secrets(path: Path) -> Secrets:
    """The secrets at `path`, made on the first start of the first server."""
    ensure_private_dir(path.parent)
    if not path.exists() and not path.is_symlink():
        write_secrets(path, Secrets.generate())
    return read_secrets(path)


def write_secrets(path: Path, found: Secrets) -> None:
    write_atomic(path, json.dumps(found.model_dump()) + "\n", mode=0o600)


def read_secrets(path: Path) -> Secrets:
    fix = (
        f"restore {path} from another server's state dir, or start this server again from a "
        "peer file (`capyctl invite server` on a running server)"
    )
    text = read_private(path, missing=fix, fix=fix)
    try:
        return Secrets.model_validate_json(text)
    except ValidationError:
        raise CredentialsUnusable(f"{path} does not hold the replication secrets; {fix}") from None


def keep_initial_primary(path: Path, host: str) -> None:
    """Keep the address of the Redis a server follows (or is) at its first start:
    `paths.initial_primary`, from this server's own address or its peer file."""
    ensure_private_dir(path.parent)
    write_atomic(path, host + "\n", mode=0o600)


def read_initial_primary(path: Path) -> str | None:
    """The initial primary kept at `path`; None before the server's first replicated start."""
    try:
        host = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise InvalidConfig(
            f"cannot read {path}: {reason}; fix its mode, or write there the address of "
            "the server this one replicated first"
        ) from None
    try:
        check_dial_host(host)
    except ValueError as exc:
        raise InvalidConfig(
            f"{path} does not hold a server's address ({exc}); write there the address "
            "(replication.advertise) of the server this one replicated first"
        ) from None
    return host


def redis_user_lines(found: Secrets) -> list[str]:
    """The replication users' lines of each server's Redis ACL file (written anew at each
    start, beside the control plane's user and the hosts')."""
    return [
        _user_line(REPLICA_USER, found.replica, REPLICA_RULES),
        _user_line(SENTINEL_USER, found.sentinel, SENTINEL_RULES),
    ]


def sentinel_user_lines(found: Secrets) -> list[str]:
    """The users of each server's Sentinel: its default user off (a client that does not log
    in can do nothing), the Sentinels' own user with every right, and the user every client
    asks for the primary as."""
    return [
        "user default off",
        _user_line(PEER_USER, found.peer, ("allchannels", "+@all")),
        _user_line(DISCOVER_USER, found.discover, DISCOVER_RULES),
    ]


def _user_line(user: str, password: str, rules: tuple[str, ...]) -> str:
    """An ACL file's line for `user`: its password kept as `#` and its SHA-256, as
    `capycommon.state.acl` keeps the others (not imported here: every client reads this
    module, and the state layer brings the Redis client with it)."""
    hashed = "#" + hashlib.sha256(password.encode()).hexdigest()
    return " ".join(["user", user, "on", hashed, *rules])


def topology(servers: tuple[str, ...], sentinel_port: int, found: Secrets) -> Topology:
    """What clients find the primary with: every server's Sentinel, in one order whichever
    server publishes it (a host rewrites its joined file only when the topology changed)."""
    return Topology(
        service=SERVICE,
        sentinels=tuple(sorted(_joined(host, sentinel_port) for host in servers)),
        user=DISCOVER_USER,
        password=found.discover,
    )


def _joined(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
