"""The stand-in for vLLM's `VLLM::EngineCore` child: it holds the simulated device memory.

It reads the holder protocol's lines from its parent on stdin (`enginesim.ranks`), claims
what they say, and answers `ok` on stdout once an allocation is claimed (a release lands
after the lag). With one rank it holds the memory itself; in the CUDA mode (`enginesim.cuda`)
as real device memory too, as vLLM's EngineCore holds the engine's. With `--ranks N` > 1 it
holds nothing itself and starts N `VLLM::Worker_TP<i>` children instead, as vLLM's
multiprocessing executor does, rank i holding its share on the i-th device `--uuid` lists;
each change goes to every worker. A worker that dies on its own takes the executor down:
`Worker proc VllmWorker-<i> died unexpectedly, shutting down executor.`, the other workers
stopped, exit 1, which its parent, the API server, notices.
SIGTERM or SIGINT: release (stopping the workers) and exit 0. End of stdin (the parent died):
keep holding until killed (`--orphan stay`, as vLLM's EngineCore does, its workers with it)
or release and exit (`--orphan exit`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from capycommon import simgpu
from enginesim import cuda
from enginesim.gpu import Holder, LocalHolder, NoHolder, SimDevice
from enginesim.ranks import Ranks, die, exit_on_stop_signals, serve_lines

WORKER_TITLE = "VLLM::Worker_TP"


def _devices(args: argparse.Namespace) -> list[SimDevice | None]:
    """Each rank's simulated device, in rank order; None for each with simulation off."""
    if args.dir is None:
        return [None] * args.ranks
    folder = Path(args.dir)
    known = {device.uuid: device for device in simgpu.read_devices(folder)}
    wanted = args.uuid.split(",")
    missing = [uuid for uuid in wanted if uuid not in known]
    if missing or len(wanted) != args.ranks:
        raise SystemExit(f"EngineCore: no simulated device {', '.join(missing)} in {folder}")
    return [SimDevice(folder, known[uuid]) for uuid in wanted]


def _holder(args: argparse.Namespace) -> Holder:
    """The claims: this process's own (with real device memory behind them in the CUDA
    mode), or its workers' with more than one rank."""
    devices = _devices(args)
    if args.ranks > 1:
        return Ranks(WORKER_TITLE, devices, args.lag)
    device = devices[0]
    claims: Holder = NoHolder() if device is None else LocalHolder(device, args.lag)
    try:
        return cuda.wrap(claims, os.environ)
    except cuda.CudaUnavailable as exc:
        claims.close()
        raise SystemExit(f"EngineCore: {exc}") from None


def _executor_down(ranks: Ranks, rank: int) -> NoReturn:
    """A worker died on its own: the executor stops the others and the EngineCore exits."""
    print(
        f"Worker proc VllmWorker-{rank} died unexpectedly, shutting down executor.",
        file=sys.stderr,
        flush=True,
    )
    ranks.close()
    os._exit(1)


def _die(holder: Holder, rank: int, code: int, message: str) -> None:
    """A `die` line: to the rank's worker, or (one rank) this process dies itself."""
    if isinstance(holder, Ranks):
        holder.kill_rank(rank, code, message)
        return
    if rank == 0:
        die(holder, code, message)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="EngineCore")
    parser.add_argument("--dir")
    parser.add_argument("--uuid", help="the device's UUID; with --ranks, one per rank, by ,")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--lag", type=float, default=0.0)
    parser.add_argument("--orphan", choices=("stay", "exit"), default="stay")
    args = parser.parse_args(argv)
    exit_on_stop_signals()
    holder = _holder(args)
    if isinstance(holder, Ranks):
        workers = holder
        workers.watch(lambda rank, code: _executor_down(workers, rank))
    try:
        serve_lines(holder, lambda rank, code, message: _die(holder, rank, code, message))
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
