"""The stand-in for vLLM's `VLLM::EngineCore` child: it holds the simulated device memory.

It reads `<gpu_bytes> <host_bytes>` lines from its parent on stdin, claims that much, and
answers `ok` on stdout once an allocation is claimed (a release lands after the lag). In the
CUDA mode (`enginesim.cuda`) it holds the claim as real device memory too, as vLLM's
EngineCore holds the engine's.
SIGTERM or SIGINT: release and exit 0. End of stdin (the parent died): keep holding until
killed (`--orphan stay`, as vLLM's EngineCore does) or release and exit (`--orphan exit`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from capycommon import simgpu
from enginesim import cuda
from enginesim.gpu import Holder, LocalHolder, NoHolder, SimDevice


def _stop(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _claims(args: argparse.Namespace) -> Holder:
    if args.dir is None:
        return NoHolder()
    folder = Path(args.dir)
    for device in simgpu.read_devices(folder):
        if device.uuid == args.uuid:
            return LocalHolder(SimDevice(folder, device), args.lag)
    raise SystemExit(f"EngineCore: no simulated device {args.uuid} in {folder}")


def _holder(args: argparse.Namespace) -> Holder:
    """The claims, with real device memory behind them in the CUDA mode."""
    claims = _claims(args)
    try:
        return cuda.wrap(claims, os.environ)
    except cuda.CudaUnavailable as exc:
        claims.close()
        raise SystemExit(f"EngineCore: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="EngineCore")
    parser.add_argument("--dir")
    parser.add_argument("--uuid")
    parser.add_argument("--lag", type=float, default=0.0)
    parser.add_argument("--orphan", choices=("stay", "exit"), default="stay")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    holder = _holder(args)
    try:
        for line in sys.stdin.buffer:
            gpu_bytes, host_bytes = (int(part) for part in line.split())
            holder.set(gpu_bytes, host_bytes)
            with contextlib.suppress(BrokenPipeError):
                sys.stdout.write("ok\n")
                sys.stdout.flush()
        if args.orphan == "stay":
            print(
                f"EngineCore {os.getpid()}: the API server is gone; holding on",
                file=sys.stderr,
                flush=True,
            )
            while True:
                signal.pause()
    finally:
        holder.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
