"""What this machine offers the check: where it runs from, redis-server, and torch.

torch is looked for, never installed: in the interpreter given with `--python`, then in this
one, then in the system's `python3`. Each is asked in a process of its own (importing torch
takes seconds and initialises CUDA's driver, which the check keeps out of its own process).
The engine simulator's CUDA mode needs a torch that this interpreter's minor version can
import (the engine runs on this Python, with the folder holding that torch added to its
environment); the attribution step's child runs on whichever interpreter has one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import capyctl_cli

NVML_TESTS = Path("tests/integration/memwatch/test_memwatch_nvml.py")
SYSTEM_PYTHONS = ("python3", "/usr/bin/python3", "/usr/local/bin/python3")
PROBE_TIMEOUT_S = 120.0
# Run by each interpreter asked: one JSON line, whether torch imports or not.
TORCH_PROBE = """
import json, os, sys
try:
    import torch
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    raise SystemExit(0)
print(json.dumps({
    "version": torch.__version__,
    "packages": os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__))),
    "python": list(sys.version_info[:2]),
    "cuda": bool(torch.cuda.is_available()),
    "cuda_version": torch.version.cuda,
}))
"""


def clone_root() -> Path | None:
    """The clone this capyctl runs from (its packages installed editable), or None for a
    release executable, which carries no tests."""
    here = Path(capyctl_cli.__file__).resolve()
    for parent in here.parents:
        if (parent / NVML_TESTS).is_file() and (parent / "scripts" / "gpu-check").is_file():
            return parent
    return None


def redis_server() -> str | None:
    return shutil.which("redis-server")


@dataclass(frozen=True)
class Torch:
    """A torch that an interpreter of this machine imports."""

    python: str
    version: str
    packages: Path  # the folder holding the `torch` package
    python_version: tuple[int, int]
    cuda: bool
    cuda_version: str | None

    @property
    def ours(self) -> bool:
        """Whether this interpreter's minor version can import it."""
        return self.python_version == sys.version_info[:2]

    def describe(self) -> str:
        major, minor = self.python_version
        return f"torch {self.version} (CUDA {self.cuda_version}) for Python {major}.{minor}"


@dataclass(frozen=True)
class TorchSearch:
    found: tuple[Torch, ...]
    tried: tuple[str, ...]  # each interpreter asked, with why it has none

    def with_cuda(self) -> Torch | None:
        return next((t for t in self.found if t.cuda), None)

    def for_engines(self) -> Torch | None:
        return next((t for t in self.found if t.cuda and t.ours), None)

    def why_none_for_engines(self) -> str:
        """Why the engine simulator cannot have real memory here, naming the fix."""
        here = f"Python {sys.version_info[0]}.{sys.version_info[1]} ({sys.executable})"
        if not self.found:
            return (
                f"no torch here ({'; '.join(self.tried)}): install torch with CUDA for {here}, "
                "or pass --python with an interpreter that has it"
            )
        cuda = [t for t in self.found if t.cuda]
        if not cuda:
            found = self.found[0]
            return (
                f"{found.describe()} at {found.python} sees no CUDA device (a CPU-only build, "
                "or CUDA_VISIBLE_DEVICES hides the GPUs)"
            )
        other = cuda[0]
        return (
            f"{other.describe()} at {other.python}, but capyctl runs on {here}, which cannot "
            "import it: run the executable with that Python, or install torch for this one"
        )


def candidates(given: str | None) -> list[str]:
    """The interpreters to ask, in order, each once."""
    names = [given] if given else []
    names.append(sys.executable)
    names += [found for name in SYSTEM_PYTHONS if (found := shutil.which(name)) is not None]
    return list(dict.fromkeys(names))


def probe(python: str) -> Torch | str:
    """The torch `python` imports, or why it has none."""
    try:
        done = subprocess.run(
            [python, "-c", TORCH_PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"{python}: exit {done.returncode}, {done.stderr.strip()[-200:]!r}"
    if "error" in answer:
        return f"{python}: {answer['error']}"
    major, minor = answer["python"]
    return Torch(
        python=python,
        version=answer["version"],
        packages=Path(answer["packages"]),
        python_version=(major, minor),
        cuda=answer["cuda"],
        cuda_version=answer["cuda_version"],
    )


def find_torch(pythons: Sequence[str]) -> TorchSearch:
    found: list[Torch] = []
    tried: list[str] = []
    for python in pythons:
        answer = probe(python)
        if not isinstance(answer, Torch):
            tried.append(answer)
            continue
        found.append(answer)
        if answer.cuda and answer.ours:
            break  # all the check needs: the others would cost seconds each
    return TorchSearch(tuple(found), tuple(tried))
