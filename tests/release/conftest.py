"""The release tests' releases: built once for the whole run (two builds take minutes), by
whichever test process asks first; the others wait on the lock and serve the same files. The
older release has the self-contained executable of this machine, which the installer prefers;
the newer has the pex alone, so upgrading and rolling back crosses the two."""

from __future__ import annotations

import fcntl
import functools
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from release.builds import NEW, OLD, Quiet, Releases, build, signing_key


def _built(folder: Path) -> Path:
    """`folder/releases`, with both releases and `latest/` built into it once; the signing
    key beside it (not in the served folder). Returns the key."""
    key = folder / "release-key" / "release"
    with (folder / "releases.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        served = folder / "releases"
        if not (folder / "releases.done").exists():
            shutil.rmtree(served, ignore_errors=True)
            shutil.rmtree(key.parent, ignore_errors=True)
            signing_key(key.parent, key.name)
            build(OLD, served / f"v{OLD}", key, binary=True)
            build(NEW, served / f"v{NEW}", key)
            shutil.copytree(served / f"v{NEW}", served / "latest")
            (folder / "releases.done").touch()
    return key


@pytest.fixture(scope="session")
def releases(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Iterator[Releases]:
    # Every worker of a parallel run shares its base folder's parent; pytest keeps the last
    # few runs' folders and removes older ones.
    base = tmp_path_factory.getbasetemp()
    folder = base if worker_id == "master" else base.parent
    key = _built(folder)
    handler = functools.partial(Quiet, directory=str(folder / "releases"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Releases(folder / "releases", f"http://127.0.0.1:{server.server_address[1]}", key)
    finally:
        server.shutdown()
        server.server_close()
