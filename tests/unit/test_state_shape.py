"""The state layer has one shape: a store class per record type, each with one async
interface over a `redis.asyncio` client, all built through `capycommon.state.stores.State`,
which a service builds once. No free function of the layer takes a client, no part of it
takes a sync client, and nothing outside it builds a store of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from unit.test_state_layer import STATE, outside_files

# The layer's own infrastructure, which no record lives in: loading and calling the Lua
# library, and subscribing to channels. Their functions take the client a store holds.
INFRASTRUCTURE = {"functions", "notify"}


def _annotation(node: ast.arg) -> str:
    return "" if node.annotation is None else ast.unparse(node.annotation)


def client_functions(path: Path) -> list[str]:
    """`line: name` for each public module-level function that takes a Redis client."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name[0] == "_":
            continue
        if any("Redis" in _annotation(arg) for arg in node.args.args):
            found.append(f"{node.lineno}: {node.name}")
    return found


def sync_clients(path: Path) -> list[str]:
    """`line: annotation` for each parameter typed as a sync client (`redis.Redis`)."""
    return [
        f"{node.lineno}: {_annotation(node)}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.arg) and _annotation(node) in {"redis.Redis", "Redis"}
    ]


def stores(path: Path) -> set[str]:
    """The classes of a module that are built from a client alone: its stores."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                params = item.args.args[1:]
                on_client = bool(params) and params[0].arg == "client"
                only = len(params) == 1 or node.name == "InstanceStore"  # and its host
                if on_client and only and "Redis" in _annotation(params[0]):
                    found.add(node.name)
    return found


def built(state_file: Path) -> set[str]:
    """The classes `State` builds (every name it calls)."""
    tree = ast.parse(state_file.read_text())
    (state,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "State")
    return {
        node.func.id
        for node in ast.walk(state)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }


def constructions(path: Path, names: set[str]) -> list[str]:
    """`line: name` for each call that builds one of `names`."""
    return [
        f"{node.lineno}: {node.func.id}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
    ]


def _state_modules() -> list[Path]:
    return sorted(path for path in STATE.glob("*.py") if path.stem != "__init__")


def _all_stores() -> set[str]:
    """Every store of the layer (the aggregate and its sync wrapper aside)."""
    return set().union(*(stores(path) for path in _state_modules() if path.stem != "stores"))


@pytest.mark.parametrize("path", _state_modules(), ids=lambda p: p.stem)
def test_no_free_function_takes_a_client_and_none_a_sync_one(path: Path) -> None:
    if path.stem not in INFRASTRUCTURE:
        assert client_functions(path) == [], "make it a method of the record's store"
    assert sync_clients(path) == [], "one async interface: sync callers go through Blocking"


def test_state_builds_every_store() -> None:
    found = _all_stores()
    assert {"HeartbeatStore", "InstanceStore", "DeploymentStore", "MemoryStore"} <= found
    assert found - built(STATE / "stores.py") == set()


def test_nothing_outside_the_layer_builds_a_store() -> None:
    names = _all_stores()
    found = {str(path): constructions(path, names) for path in outside_files()}
    assert {path: lines for path, lines in found.items() if lines} == {}, "use State"


def test_the_checks_see_free_functions_sync_clients_and_stores(tmp_path: Path) -> None:
    module = tmp_path / "thing.py"
    module.write_text(
        "import redis\nimport redis.asyncio as aioredis\n\n"
        "async def aread(client: aioredis.Redis, host: str) -> None: ...\n\n"
        "def read(client: redis.Redis) -> None: ...\n\n"
        "def _helper(client: aioredis.Redis) -> None: ...\n\n"
        "class ThingStore:\n"
        "    def __init__(self, client: aioredis.Redis) -> None: ...\n\n"
        "class Book:\n"
        "    def __init__(self, client: aioredis.Redis, owner: str) -> None: ...\n\n"
        "store = ThingStore(None)\n"
    )
    assert client_functions(module) == ["4: aread", "6: read"]
    assert sync_clients(module) == ["6: redis.Redis"]
    assert stores(module) == {"ThingStore"}
    assert constructions(module, {"ThingStore"}) == ["16: ThingStore"]
    aggregate = tmp_path / "stores.py"
    aggregate.write_text("class State:\n    def things(self):\n        return ThingStore(1)\n")
    assert built(aggregate) == {"ThingStore"}
