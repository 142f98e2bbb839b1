"""The release tests' releases: built once for the session (two builds take minutes)."""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from collections.abc import Iterator

import pytest

from release.builds import NEW, OLD, Quiet, Releases, build, signing_key
from support import short_dir


@pytest.fixture(scope="session")
def releases() -> Iterator[Releases]:
    folder = short_dir("capy-releases")
    keys = short_dir("capy-release-key")  # not in the served folder
    key = signing_key(keys, "release")
    build(OLD, folder / f"v{OLD}", key)
    build(NEW, folder / f"v{NEW}", key)
    shutil.copytree(folder / f"v{NEW}", folder / "latest")
    handler = functools.partial(Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Releases(folder, f"http://127.0.0.1:{server.server_address[1]}", key)
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(keys, ignore_errors=True)
