"""`capyctl-router --role ROLE`: serve the inference API, from `server.router.workers`
worker processes on one listener (`capyctl_router.workers`). The parent holds the listener
and its workers; only a worker loads the API (`capyctl_router.worker`)."""

from __future__ import annotations

import argparse
import functools
import socket
import sys
from collections.abc import Sequence

from capycommon.service import run
from capyctl_router.workers import run_workers, worker_name


def main(argv: Sequence[str] | None = None) -> None:
    """The parent, or (with --worker and --listen-fd, as the parent starts them) a worker."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--worker", type=int)
    parser.add_argument("--listen-fd", type=int)
    found, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if found.worker is None:
        sys.exit(run("router", functools.partial(run_workers, argv=rest), rest))
    import uvloop  # noqa: PLC0415 - the parent never serves

    from capyctl_router.worker import serve  # noqa: PLC0415 - the parent never serves

    listener = socket.socket(fileno=found.listen_fd)
    body = functools.partial(serve, listener=listener, events=found.worker == 0)
    # A worker's event loop is libuv's (uvloop): every request's turns of the loop, its
    # sockets' reads and writes and its timers cost about half of asyncio's own (bench/).
    sys.exit(run(worker_name(found.worker), body, rest, loop_factory=uvloop.new_event_loop))


if __name__ == "__main__":
    main()
