"""`python -m capyctl_cli.gpucheck`: run the steps in order, one line each, then the summary.

What the steps share is found once, when the first step needs it, and kept in `Check`: the
GPU readings (memwatch's, every 50 ms, for the whole run), torch, and the role of steps 4 to
6. What one step cannot find is that step's SKIP, and every later step's that needs it too.
"""

from __future__ import annotations

import argparse
import functools
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from capycommon.version import __version__
from capyctl_cli.gpucheck import attribution, enginesteps, machine, nvmltests, rolestep
from capyctl_cli.gpucheck.bench import Bench
from capyctl_cli.gpucheck.devicewatch import DeviceWatch
from capyctl_cli.gpucheck.machine import TorchSearch
from capyctl_cli.gpucheck.report import Outcome, Skip, exit_code, run_step, summary
from capyctl_cli.gpucheck.role import end_left_under
from capyctl_cli.output import echo


@dataclass
class Check:
    folder: Path
    root: Path | None
    python: str | None
    simulated: str | None  # a simulated GPU list: the check's own tests rehearse on one
    _watch: DeviceWatch | Skip | None = None
    _torch: TorchSearch | None = None
    _bench: Bench | Skip | None = None
    role_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.simgpu is not None and self.simulated:
            self.role_env = {
                "CAPYCTL_SIMULATED_GPUS": self.simulated,
                "CAPYCTL_SIMGPU_DIR": str(self.simgpu),
            }

    @property
    def simgpu(self) -> Path | None:
        return self.folder / "simgpu" if self.simulated else None

    @property
    def backend(self) -> str:
        return "simulated" if self.simulated else "nvml"

    def watch(self) -> DeviceWatch:
        if self._watch is None:
            simulated = (self.simgpu, self.simulated) if self.simgpu and self.simulated else None
            try:
                self._watch = DeviceWatch.start(simulated)
            except Skip as exc:
                self._watch = exc
        if isinstance(self._watch, Skip):
            raise self._watch
        return self._watch

    def torch(self) -> TorchSearch:
        if self._torch is None:
            self._torch = machine.find_torch(machine.candidates(self.python))
        return self._torch

    def redis(self) -> None:
        if machine.redis_server() is None:
            raise Skip(
                "redis-server is not installed (the role runs Debian's): "
                "apt-get install redis-server"
            )

    def bench(self) -> Bench:
        """The role of steps 4 to 6, opened by the first of them to run."""
        if self._bench is None:
            watch = self.watch()
            self.redis()
            torch = self.torch().for_engines()
            if torch is None:
                self._bench = Skip(self.torch().why_none_for_engines())
                raise self._bench
            self._bench = Skip("the role of steps 4 to 6 did not start (see step 4)")
            self._bench = Bench.open(self.folder / "bench", watch, torch, self.role_env)
        if isinstance(self._bench, Skip):
            raise self._bench
        return self._bench

    def close(self) -> None:
        if isinstance(self._bench, Bench):
            self._bench.close()
        if isinstance(self._watch, DeviceWatch):
            self._watch.close()
        end_left_under(self.folder)


def _role_step(check: Check) -> str:
    watch = check.watch()
    check.redis()
    return rolestep.check(check.folder / "role", watch, check.backend, check.role_env)


STEPS: list[tuple[str, Callable[[Check], str]]] = [
    ("nvml-attribution", lambda c: attribution.check(c.watch(), c.torch(), c.simgpu)),
    ("nvml-tests", lambda c: nvmltests.check(c.root)),
    ("role-on-gpu", _role_step),
    ("engine-on-cuda", lambda c: enginesteps.engine_on_cuda(c.bench())),
    ("models-in-turn", lambda c: enginesteps.models_in_turn(c.bench())),
    ("clean-drain", lambda c: enginesteps.clean_drain(c.bench())),
]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu-check", description="CapyCTL on this machine's NVIDIA GPU."
    )
    parser.add_argument("--python", help="an interpreter whose torch the check may use")
    parser.add_argument("--simulated-gpus", help=argparse.SUPPRESS)  # the check's own tests
    return parser.parse_args(argv)


def run(check: Check) -> list[Outcome]:
    outcomes = []
    for number, (name, step) in enumerate(STEPS, start=1):
        outcome = run_step(number, name, functools.partial(step, check))
        echo(outcome.line())
        outcomes.append(outcome)
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    started = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-", dir="/tmp"))  # short: unix sockets
    root = machine.clone_root()
    source = f"a clone at {root}" if root else "a release executable"
    echo(
        f"gpu-check: capyctl {__version__}, Python {platform.python_version()} "
        f"({sys.executable}), from {source}"
    )
    echo(f"gpu-check: working in {folder}")
    check = Check(folder, root, args.python, args.simulated_gpus)
    try:
        outcomes = run(check)
    finally:
        check.close()
    echo(summary(outcomes, time.monotonic() - started))
    code = exit_code(outcomes)
    if code:
        echo(f"gpu-check: the logs are kept in {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
