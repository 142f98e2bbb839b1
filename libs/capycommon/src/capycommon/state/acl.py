"""The server Redis's users: the control plane's own, and one per joined host limited to its
host's prefix.

A host's hostd and memwatch write only under `capyctl:host:<name>:`, read their command
stream there, and announce on their own channels; the keys they read outside it are the
server's version and the scheduler's fencing epoch (to refuse a command from a scheduler
that lost its lease, `capycommon.state.leader`). So a host's user may touch exactly that
prefix, read those two keys, and run only the commands hostd and memwatch send. Nothing
else: no other host's keys, no desired state, no key names of others (no SCAN, KEYS,
RANDOMKEY), no server commands (no CONFIG, ACL, CLIENT LIST, MONITOR, FLUSHALL), and no
scripts of its own (no EVAL, EVALSHA, SCRIPT, FUNCTION LOAD/DELETE/FLUSH): a script holds
the whole server while it runs. A host calls the control plane's functions (`functions`,
FCALL) instead, whose keys Redis checks against the host's patterns as it checks a
command's.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from capycommon.state import keys, quarantine

CONTROL_USER = "capyctl"
HOST_USER_PREFIX = "host-"

# Exactly what hostd and memwatch send. (redis-py also sends CLIENT SETINFO on connect,
# which Redis 7.0 does not have; it ignores the refusal either way.)
HOST_COMMANDS = (
    "ping",
    "auth",
    "hello",
    "client|setname",
    "get",
    "set",
    "del",
    "unlink",
    "exists",
    "expire",
    "pexpire",
    "mget",
    "getdel",
    "hset",
    "hget",
    "hgetall",
    "hdel",
    "hincrby",
    "sadd",
    "srem",
    "smembers",
    "sismember",
    "rpush",
    "lrange",
    "ltrim",
    "xadd",
    "xread",
    "xreadgroup",
    "xack",
    "xgroup|create",
    "xautoclaim",
    "xrange",
    "xrevrange",
    "xtrim",
    "xlen",
    "publish",
    "subscribe",
    "unsubscribe",
    "fcall",
    "multi",
    "exec",
    "discard",
    "watch",
    "unwatch",
    "time",
)


# What a host may read outside its prefix.
READABLE = (
    f"%R~{keys.server_version()}",
    f"%R~{keys.scheduler_epoch()}",
    f"%R~{keys.topology()}",
)


# What a recorded host user must be: a host's name, and a SHA-256 in hex.
HOST_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
DIGEST = re.compile(r"[0-9a-f]{64}")


def host_user(host: str) -> str:
    return f"{HOST_USER_PREFIX}{host}"


def password_hash(password: str) -> str:
    """How an ACL file keeps a password: `#` and its SHA-256, never the password."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def host_rules(host: str, password: str) -> list[str]:
    """The ACL SETUSER rules of a host's user, from nothing (`reset`)."""
    return _rules(host, f">{password}")


def _rules(host: str, secret: str) -> list[str]:
    """A host user's rules with its password given as `secret`: `>password` or `#digest`."""
    prefix = keys.host_prefix(host)
    return [
        "reset",
        "on",
        secret,
        f"~{prefix}:*",
        *READABLE,
        f"&{prefix}:*",
        "-@all",
        *(f"+{command}" for command in HOST_COMMANDS),
    ]


def acl_file(control_password: str, kept_lines: list[str]) -> str:
    """The server Redis's ACL file: its default user, the control plane's user with every
    right, and the host users kept from the file as Redis last saved it.

    The default user has every right and a password nobody knows (a new one at each start):
    a client that does not log in as a user of its own can do nothing, as it must not. It
    is not turned off, because Redis 7.0 replays its append-only file as the default user and
    checks each transaction's commands against that user's rights again at EXEC: with the
    default user off, every MULTI/EXEC written before a restart was dropped on loading it
    (redis/redis#14541), and a restarted server lost its deployments."""
    unknown = secrets.token_hex(32)
    lines = [
        f"user default on {password_hash(unknown)} ~* &* +@all",
        f"user {CONTROL_USER} on {password_hash(control_password)} ~* &* +@all",
        *kept_lines,
    ]
    return "\n".join(lines) + "\n"


def host_lines(text: str) -> list[str]:
    """The host users' lines of an ACL file Redis saved, each with the commands a host may
    run now (HOST_COMMANDS) and the keys it may read outside its prefix now (READABLE),
    whatever it was saved with: a host that joined under an older release loses what hosts
    no longer have (EVAL, SCRIPT LOAD) and gains what they have since, at the server's next
    start. Its password, keys and channels stay as saved."""
    return [
        current_rights(line.strip())
        for line in text.splitlines()
        if line.strip().startswith(f"user {HOST_USER_PREFIX}")
    ]


def current_rights(line: str) -> str:
    """A saved user line with its command rules (`+...`, `-...`) replaced by HOST_COMMANDS,
    and each READABLE pattern it lacks added."""
    kept = [word for word in line.split() if not word.startswith(("+", "-"))]
    kept += [pattern for pattern in READABLE if pattern not in kept]
    return " ".join([*kept, "-@all", *(f"+{command}" for command in HOST_COMMANDS)])


class HostUserStore:
    """The hosts' Redis users, kept in the ACL file, and recorded (by their password's
    digest) where replication carries them to the other servers' Redis: replication carries
    data, not users, so each replica's server makes its Redis's host users match the record
    (`mirror`)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def set(self, host: str, password: str) -> None:
        """Make (or remake) a host's user, and save the ACL file so a restart keeps it."""
        digest = hashlib.sha256(password.encode()).hexdigest()
        await self.client.hset(keys.host_users(), host, digest)
        await _command(self.client, "ACL", "SETUSER", host_user(host), *host_rules(host, password))
        await _command(self.client, "ACL", "SAVE")

    async def remove(self, host: str) -> None:
        """Close a host user's connections and delete it; nothing happens for one that is
        gone."""
        await self._drop(host)
        await self.client.hdel(keys.host_users(), host)
        await _command(self.client, "ACL", "SAVE")

    async def recorded(self) -> dict[str, str]:
        """The host users on record: host -> its password's digest (a value that is not one
        is refused)."""
        key = keys.host_users()
        found = {}
        for name, value in (await self.client.hgetall(key)).items():
            host, digest = _text(name), _text(value)
            if HOST_NAME.fullmatch(host) and DIGEST.fullmatch(digest):
                found[host] = digest
            else:
                quarantine.REFUSALS.refuse(key, f"{host}={digest}", "not a host's digest")
        return found

    async def held(self) -> dict[str, str]:
        """The host users this Redis has: host -> its password's digest."""
        lines: list[bytes | str] = await _command(self.client, "ACL", "LIST")
        found = {}
        for raw in lines:
            words = _text(raw).split()
            if len(words) < 2 or not words[1].startswith(HOST_USER_PREFIX):
                continue
            digests = [word[1:] for word in words if word.startswith("#")]
            found[words[1].removeprefix(HOST_USER_PREFIX)] = digests[0] if digests else ""
        return found

    async def record_held(self) -> int:
        """Record every host user this Redis has and the record lacks (hosts that joined
        before the record was kept); how many."""
        recorded = await self.recorded()
        missing = {h: d for h, d in (await self.held()).items() if h not in recorded and d}
        for host, digest in missing.items():
            await self.client.hsetnx(keys.host_users(), host, digest)
        return len(missing)

    async def mirror(self, wanted: dict[str, str]) -> tuple[list[str], list[str]]:
        """Make this Redis's host users exactly `wanted` (host -> digest), saving the ACL
        file if anything changed: (hosts made or remade, hosts removed)."""
        held = await self.held()
        made = sorted(host for host, digest in wanted.items() if held.get(host) != digest)
        removed = sorted(set(held) - set(wanted))
        for host in made:
            rules = _rules(host, f"#{wanted[host]}")
            await _command(self.client, "ACL", "SETUSER", host_user(host), *rules)
        for host in removed:
            await self._drop(host)
        if made or removed:
            await _command(self.client, "ACL", "SAVE")
        return made, removed

    async def _drop(self, host: str) -> None:
        user = host_user(host)
        with suppress(ResponseError):  # no such user
            await _command(self.client, "CLIENT", "KILL", "USER", user)
        await _command(self.client, "ACL", "DELUSER", user)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


async def _command(client: aioredis.Redis, *args: str) -> Any:
    # redis-py leaves execute_command untyped; these commands go to Redis as written.
    command: Callable[..., Awaitable[Any]] = client.execute_command
    return await command(*args)
