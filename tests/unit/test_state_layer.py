"""Redis is reached through one layer, `capycommon.state`: it alone spells the keys and sends
commands on them. Everything else calls its stores and functions, so a key's shape, its
type and the transactions around it change in one place."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CAPYCOMMON = ROOT / "libs" / "capycommon" / "src" / "capycommon"
STATE = CAPYCOMMON / "state"
OUTSIDE = {
    "capycommon": CAPYCOMMON,
    "capyctl_router": ROOT / "services" / "router" / "src" / "capyctl_router",
    "capyctl_scheduler": ROOT / "services" / "scheduler" / "src" / "capyctl_scheduler",
    "capyctl_hostd": ROOT / "services" / "hostd" / "src" / "capyctl_hostd",
    "capyctl_memwatch": ROOT / "services" / "memwatch" / "src" / "capyctl_memwatch",
    "capyctl_cli": ROOT / "cli" / "src" / "capyctl_cli",
}
# Redis commands on keys, by their redis-py names. Those that are common words elsewhere
# (dicts, paths, lists, HTTP clients) count only when called on a Redis client or pipeline.
COMMANDS = {
    "blpop", "brpop", "decr", "eval", "evalsha", "getdel",
    "hdel", "hget", "hgetall", "hincrby", "hkeys", "hmget", "hset", "incr", "incrby",
    "llen", "lpop", "lpush", "lrange", "ltrim", "mget", "mset", "pexpire", "pipeline",
    "psubscribe", "pubsub", "register_script", "rpop", "rpush", "sadd", "scan",
    "scan_iter", "scard", "setex", "setnx", "sismember", "smembers", "srem", "subscribe",
    "ttl", "xack", "xadd", "xautoclaim", "xclaim", "xdel", "xgroup_create",
    "xlen", "xpending", "xrange", "xread", "xreadgroup", "xrevrange", "xtrim", "zadd",
    "zrange", "zrem",
}  # fmt: skip
ON_A_CLIENT = {"get", "set", "delete", "exists", "expire", "append", "publish", "unlink", "watch"}
CLIENTS = {"client", "redis", "pipe", "p"}


def _receiver(node: ast.expr) -> str:
    """The last name of what a method is called on: `self.client.get` -> `client`."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def raw_redis(path: Path) -> list[str]:
    """`line: what` for each Redis command or key spelling in a file outside the layer."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, receiver = node.func.attr, _receiver(node.func.value).lower()
            on_client = receiver in CLIENTS
            if (name in COMMANDS and receiver != "self") or (name in ON_A_CLIENT and on_client):
                found.append(f"{node.lineno}: {receiver}.{name}()")
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
            if "capycommon.state.keys" in names:
                found.append(f"{node.lineno}: imports capycommon.state.keys")
        elif isinstance(node, ast.Import) and any(
            alias.name == "capycommon.state.keys" for alias in node.names
        ):
            found.append(f"{node.lineno}: imports capycommon.state.keys")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def outside_files() -> list[Path]:
    """The Python files of every package but the state layer's own."""
    return sorted(
        path
        for folder in OUTSIDE.values()
        for path in folder.rglob("*.py")
        if STATE not in path.parents
    )


@pytest.mark.parametrize("path", outside_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_no_redis_command_outside_the_state_layer(path: Path) -> None:
    assert raw_redis(path) == [], f"{path.name}: go through capycommon.state"


def test_the_check_sees_raw_commands_and_keys(tmp_path: Path) -> None:
    module = tmp_path / "mod.py"
    module.write_text(
        "from capycommon.state import keys\n"
        "async def f(self, pipe, table):\n"
        "    await self.client.get(keys.hosts())\n"
        "    pipe.hdel('k', 'f')\n"
        "    async with self.client.pipeline() as p:\n"
        "        p.xadd('s', {})\n"
        "    table.get('not redis')\n"
    )
    assert raw_redis(module) == [
        "1: imports capycommon.state.keys",
        "3: client.get()",
        "4: pipe.hdel()",
        "5: client.pipeline()",
        "6: p.xadd()",
    ]
