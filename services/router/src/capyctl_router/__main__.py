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
    # A worker's event loop is libuv's (uvloop): in bench/router.py it served more short
    # chats a second at concurrency 32 than asyncio's loop (0.50 and 0.47 of direct against
    # 0.46 and 0.46); at concurrency 1 the processes' hand-offs, not the loop, cost the time.
    sys.exit(run(worker_name(found.worker), body, rest, loop_factory=uvloop.new_event_loop))


if __name__ == "__main__":
    main()
