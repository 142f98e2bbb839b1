"""`capyctl-memwatch --role ROLE`: keep this host's memwatch alive and its heartbeat fresh."""

from __future__ import annotations

import sys

from capycommon.service import run


def main() -> None:
    sys.exit(run("memwatch", None))


if __name__ == "__main__":
    main()
