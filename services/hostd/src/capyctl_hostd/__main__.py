"""`capyctl-hostd --role ROLE`: keep this host's hostd alive and its heartbeat fresh."""

from __future__ import annotations

import sys

from capycommon.service import run


def main() -> None:
    sys.exit(run("hostd", None))


if __name__ == "__main__":
    main()
