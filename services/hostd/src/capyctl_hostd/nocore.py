"""`python -m capyctl_hostd.nocore PROGRAM [ARG...]`: run PROGRAM with no core dump.

It sets the core file size limit to zero, soft and hard, and becomes PROGRAM (exec: same
PID, same session); the limit holds for PROGRAM and every process it starts, which cannot
raise it again. hostd starts the engines of a deployment with `retention: zero` through it,
so a crash of theirs writes no memory image, with its prompts, to the disk.
"""

from __future__ import annotations

import os
import resource
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m capyctl_hostd.nocore PROGRAM [ARG...]")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.execv(sys.argv[1], sys.argv[1:])  # noqa: S606 - hostd's own argv for the engine, no shell


if __name__ == "__main__":
    main()
