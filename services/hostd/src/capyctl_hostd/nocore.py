"""`python -m capyctl_hostd.nocore PROGRAM [ARG...]`: run PROGRAM with no core dump.

It sets the core file size limit to zero, soft and hard, and its core dump filter to none
of its memory (`/proc/self/coredump_filter` 0: a core written by a pipe handler that ignores
the limit holds no memory mapping), then becomes PROGRAM (exec: same PID, same session).
Both hold for PROGRAM and every process it starts (a limit that cannot be raised again, a
filter that fork and exec keep). hostd starts the engines of a deployment with
`retention: zero` through it, so a crash of theirs writes no memory image, with its prompts,
to the disk.

It does not make PROGRAM undumpable (PR_SET_DUMPABLE 0): exec resets that flag, and an engine
that set it itself would have its /proc entries owned by root, where hostd, running as the
engine's own user, reads its processes, sockets and shared memory segments.
"""

from __future__ import annotations

import os
import resource
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m capyctl_hostd.nocore PROGRAM [ARG...]")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with open("/proc/self/coredump_filter", "w", encoding="ascii") as dump_filter:
        dump_filter.write("0")
    os.execv(sys.argv[1], sys.argv[1:])  # noqa: S606 - hostd's own argv for the engine, no shell


if __name__ == "__main__":
    main()
