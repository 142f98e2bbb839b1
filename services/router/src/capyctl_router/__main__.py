"""`capyctl-router --role ROLE`: serve the inference API, from `server.router.workers`
worker processes on one listener (`capyctl_router.workers`). The parent holds the listener
and forks its workers (`capyctl_router.worker`)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

from capycommon.service import run
from capyctl_router.workers import run_workers


def main(argv: Sequence[str] | None = None) -> None:
    rest = sys.argv[1:] if argv is None else list(argv)
    sys.exit(run("router", functools.partial(run_workers, argv=rest), rest))


if __name__ == "__main__":
    main()
