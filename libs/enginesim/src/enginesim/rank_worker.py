"""One tensor-parallel rank: vLLM's `VLLM::Worker_TP<i>` or SGLang's `sglang::scheduler_TP<i>`.

python -m enginesim.rank_worker --rank I --lag S [--dir DIR --uuid UUID]

It holds the rank's share of the engine's memory as its parent tells it on stdin (the holder
protocol, `enginesim.ranks`): its claim file `<dir>/<pid>.json` on the device UUID names, and
in the CUDA mode (`enginesim.cuda`) real memory on torch device I, as the real rank allocates
after `torch.cuda.set_device(I)`. SIGTERM or SIGINT: release and exit 0. End of stdin (its
parent is gone): release and exit 0, as a real worker follows its parent out. A `die` line:
print its message on stderr, release and exit with its code.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from capycommon import simgpu
from enginesim import cuda
from enginesim.gpu import Holder, LocalHolder, NoHolder, SimDevice
from enginesim.ranks import die, exit_on_stop_signals, serve_lines


def _claims(args: argparse.Namespace) -> Holder:
    if args.dir is None:
        return NoHolder()
    folder = Path(args.dir)
    for device in simgpu.read_devices(folder):
        if device.uuid == args.uuid:
            return LocalHolder(SimDevice(folder, device), args.lag)
    raise SystemExit(f"rank {args.rank}: no simulated device {args.uuid} in {folder}")


def _holder(args: argparse.Namespace) -> Holder:
    """The claims, with real memory on the rank's own device behind them in the CUDA mode."""
    claims = _claims(args)
    try:
        return cuda.wrap(claims, os.environ, [(args.rank, 1.0)])
    except cuda.CudaUnavailable as exc:
        claims.close()
        raise SystemExit(f"rank {args.rank}: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--lag", type=float, default=0.0)
    parser.add_argument("--dir")
    parser.add_argument("--uuid")
    args = parser.parse_args(argv)
    exit_on_stop_signals()
    holder = _holder(args)
    try:
        serve_lines(holder, lambda rank, code, message: die(holder, code, message))
    finally:
        holder.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
