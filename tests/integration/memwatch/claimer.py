"""A process that holds simulated GPU memory as told, the way an engine simulator would.

    python claimer.py FOLDER

Each line on stdin is a command, answered with `ok` on stdout once done:
- `claim UUID BYTES HOST_BYTES`: (re)write this process's claim `<FOLDER>/<pid>.json`;
- `child UUID BYTES HOST_BYTES`: start a child (same process group) holding that claim;
- `pid`: answer the PIDs of this process and its children instead of `ok`.
At the end of stdin it removes its claim and exits; so do its children when it dies.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from capycommon import simgpu


def main() -> None:
    folder = Path(sys.argv[1])
    children: list[subprocess.Popen[str]] = []
    try:
        for line in sys.stdin:
            command, *args = line.split()
            if command == "claim":
                claim = simgpu.Claim(uuid=args[0], bytes=int(args[1]), host_bytes=int(args[2]))
                simgpu.write_claim(folder, os.getpid(), claim)
                answer = "ok"
            elif command == "child":
                children.append(start_child(folder, line.replace("child", "claim", 1)))
                answer = "ok"
            else:
                answer = " ".join(str(p) for p in [os.getpid(), *(c.pid for c in children)])
            print(answer, flush=True)
    finally:
        simgpu.remove_claim(folder, os.getpid())
        for child in children:
            child.communicate()


def start_child(folder: Path, command: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, __file__, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    child.stdin.write(command)
    child.stdin.flush()
    assert child.stdout.readline().strip() == "ok"
    return child


if __name__ == "__main__":
    main()
