"""The entry point of the self-contained executable: one file that is `capyctl` and also the
Python that CapyCTL starts its own processes with.

CapyCTL runs its services, supervisord, hostd's helpers and the engine simulator as
`sys.executable -m MODULE ...` (and probes an engine's environment with `-I -c CODE`). In the
executable `sys.executable` is the executable itself, so it answers those forms as `python`
would: `-m MODULE`, `-c CODE`, a script's path, after Python's switches that change nothing
here (`-I`, `-u`, `-B`, `-E`, `-s`, `-S`). Run through a virtual environment's `bin/python`
(a link to it, as `python -m venv` makes one), it also imports that environment's packages,
and without `-I` or `-E` it honours `PYTHONPATH`, as a Python would. Anything else is a
`capyctl` command.
"""

from __future__ import annotations

import os
import runpy
import site
import sys
from pathlib import Path

IGNORED_SWITCHES = frozenset({"-I", "-u", "-B", "-E", "-s", "-S"})
ISOLATING = frozenset({"-I", "-E"})


def _add_environment(invoked_as: str, isolated: bool) -> None:
    """The packages a Python run so would see: its virtual environment's, and PYTHONPATH."""
    venv = Path(invoked_as).parent.parent
    if (venv / "pyvenv.cfg").is_file():
        for packages in sorted(venv.glob("lib/python3*/site-packages")):
            site.addsitedir(str(packages))
    if not isolated:
        extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
        sys.path[1:1] = extra


def _as_python(args: list[str]) -> bool:
    """Run `args` as `python` would, if they are a Python invocation; whether they were."""
    switches = set()
    while args and args[0] in IGNORED_SWITCHES:
        switches.add(args.pop(0))
    if args[:1] == ["-m"] and len(args) > 1:
        _add_environment(sys.argv[0], bool(switches & ISOLATING))
        module = args[1]
        sys.argv = [module, *args[2:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return True
    if args[:1] == ["-c"] and len(args) > 1:
        _add_environment(sys.argv[0], bool(switches & ISOLATING))
        sys.argv = ["-c", *args[2:]]
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        return True
    if args and os.sep in args[0] and Path(args[0]).is_file():
        _add_environment(sys.argv[0], bool(switches & ISOLATING))
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")
        return True
    if switches:
        shown = " ".join(sorted(switches))
        raise SystemExit(f"capyctl: {shown} runs a module (-m), code (-c) or a script; name one")
    return False


def main() -> None:
    args = sys.argv[1:]
    if _as_python(args):
        return
    from capyctl_cli.main import main as capyctl  # noqa: PLC0415 (not for a -m run)

    capyctl()


if __name__ == "__main__":
    main()
