from __future__ import annotations

import faulthandler
import os
import shutil
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import redis

from capycommon.state import functions
from support import Role, redis_server, short_dir

# What a failed test's report carries of each service log of the roles it used.
LOG_TAIL_LINES = 30
LOG_LINE_CHARS = 400


@pytest.fixture
def redis_socket() -> Iterator[Path]:
    """A real redis-server on a private unix socket, stopped after the test, with CapyCTL's
    functions loaded, as the control plane (the scheduler) loads them in a role."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; run scripts/setup")
    folder = short_dir("redis")
    proc = redis_server(folder, "--appendonly", "no")
    try:
        with redis.Redis(unix_socket_path=str(folder / "redis.sock")) as client:
            client.function_load(functions.SOURCE, replace=True)
        yield folder / "redis.sock"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


# The files that run longest, handed to the workers first: files go to the workers in
# collection order, and a run whose last file to start is a release test (it builds and
# installs releases, minutes of it) ends with one worker busy and the others idle. One
# release file comes first, to build the releases; the others wait on that build, so they
# come after the end-to-end tests, by when it is done, instead of holding idle workers.
LONGEST_FIRST = (
    "tests/release/test_release_signature.py",
    "tests/chaos/",
    "tests/e2e/",
    "tests/release/",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        found = (i for i, start in enumerate(LONGEST_FIRST) if item.nodeid.startswith(start))
        return next(found, len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order within a folder stays


# A test whose whole run (set-up, call and tear-down) lasts this long is stuck where its
# timeout cannot reach: a tear-down that waits forever once the timeout has failed the test.
# Every thread's stack goes to the terminal and the worker ends; the run goes on without it,
# reports that test as failed, and says where it was stuck.
STUCK_S = 420
_terminal = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_terminal] = os.dup(sys.stderr.fileno())  # before a test's output is captured


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    faulthandler.dump_traceback_later(STUCK_S, exit=True, file=item.config.stash[_terminal])
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def anyio_backend() -> str:
    """Every async test runs on asyncio, the services' loop (trio, which selenium brings
    into the environment, would otherwise be tried too)."""
    return "asyncio"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test that fails while a role runs carries the tail of each of the role's service
    logs in its report: a failure seen once on a loaded machine can be read, not guessed."""
    report = yield
    if report.failed and call.when == "call":
        for role in _roles(item):
            for log in sorted((role.state_dir / "logs").glob("*.log")):
                report.sections.append((f"{role.role} {log.name}", _tail(log)))
    return report


def _roles(item: pytest.Item) -> list[Role]:
    """The roles among the test's fixtures: a role itself, or what holds one as `.role`."""
    found: list[Role] = []
    for value in getattr(item, "funcargs", {}).values():
        role = value if isinstance(value, Role) else getattr(value, "role", None)
        if isinstance(role, Role) and role not in found:
            found.append(role)
    return found


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(unreadable: {exc})"
    kept = [line[:LOG_LINE_CHARS] for line in lines if "heartbeat" not in line]
    return "\n".join(kept[-LOG_TAIL_LINES:])
