"""SGLang's launch: `python -m sglang.launch_server --model-path M` or `sglang serve ...`.

Start-up as SGLang does it: no socket while the weights load (clients are refused), then
uvicorn listens while a warm-up runs (`/health` 503), then `The server is fired up and ready
to roll!`. Memory: the budget is --mem-fraction-static x the memory free on the device when
it starts, as SGLang's `profile_max_num_token` sizes its static part (weights and KV cache)
against `get_available_gpu_memory` read before the weights load; the weights are the model
folder's weight files; CUDA graphs take min(256 MiB, a quarter of the rest); the KV cache
takes what remains, and none left is SGLang's "Not enough memory". With
--tokenizer-worker-num > 1 the process creates /dev/shm/multi_tokenizer_args_<pid>, unlinked
on a clean exit and left behind on SIGKILL.

With --enable-metrics the server makes Prometheus' multiprocess folder as SGLang does: a
TemporaryDirectory inside the folder PROMETHEUS_MULTIPROC_DIR names (which its children keep
writing to), else one in /tmp that it exports to them; either is removed when it exits. With
the `scheduler_dies` fault the scheduler and detokenizer run as children (`sglang_children`),
the scheduler dies while loading, and the server waits on without listening until stopped.

With --tp-size (--tp) N > 1 the server holds nothing itself: it starts N
`sglang::scheduler_TP<i>` children, rank i on the i-th visible device, each holding the
weights / N and its own KV cache and CUDA graphs, sized by the least memory free on any of the
devices as SGLang's `profile_max_num_token` takes the minimum over its ranks (see
`enginesim.ranks`). Release and resume move every rank's memory. A scheduler that dies makes
the server stop every child and exit non-zero. Refused at start: a model whose
`num_attention_heads` (config.json) N does not divide, and more ranks than visible devices.

`--enable-lmcache` connects to the LMCache server that `--lmcache-config-file` (or
LMCACHE_CONFIG_FILE) names with `mp_host` and `mp_port`, once the weights are loaded; its
chunk size must be a multiple of `--page-size`. LMCache's cache is a radix cache: with
`--disable-radix-cache` or `--enable-hierarchical-cache` SGLang builds another cache and
silently never connects; for a decision checkpoint, `--enable-lmcache` with
`--disable-radix-cache` fails at start instead. See `enginesim.kvconnector`.

`--is-embedding` serves an embedding or rerank model: /v1/embeddings and /v1/rerank answer
only with it (`enginesim.pooling_api`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import mmap
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from enginesim import decisions, kvconnector, ranks
from enginesim import process as proc
from enginesim.behaviour import Behaviour, SchedulerDies
from enginesim.gpu import Holder, LocalHolder, NoHolder, SimDevice, cuda_devices, with_cuda
from enginesim.kvconnector import KvConfigError, KvConnector
from enginesim.memory import Regions, finish_loading, weight_bytes
from enginesim.parallel import per_rank
from enginesim.process import Process
from enginesim.ranks import Ranks
from enginesim.sglang_app import SglangFrontend, build_app

log = logging.getLogger("sglang.srt.entrypoints.http_server")

MIB = 1 << 20
SCHEDULER_TITLE = "sglang::scheduler_TP"
CHILD_FAILED = "Received sigquit from a child process. It usually means the child failed."
SHM_DIR = Path("/dev/shm")  # noqa: S108 - SGLang names its segment there
REASONING_PARSERS = (
    "deepseek-r1",
    "deepseek-v3",
    "glm45",
    "gpt-oss",
    "kimi",
    "kimi_k2",
    "qwen3",
    "qwen3-thinking",
    "step3",
    "minimax",
    "minimax-append-think",
    "mistral",
    "interns1",
    "nano_v3",
)
IGNORED_VALUES = (
    "--dtype",
    "--quantization",
    "--tokenizer-path",
    "--revision",
    "--log-level",
    "--log-level-http",
    "--config",
    "--warmups",
    "--detokenizer-worker-num",
    "--dp|--dp-size",
    "--attention-backend",
    "--random-seed",
    "--kv-cache-dtype",
    "--max-total-tokens",
    "--max-prefill-tokens",
    "--chunked-prefill-size",
    "--schedule-policy",
    "--load-format",
    "--download-dir",
    "--device",
    "--cuda-graph-max-bs",
    "--dist-init-addr",
    "--nnodes",
    "--node-rank",
    "--ssl-keyfile",
    "--ssl-certfile",
    "--lora-paths",
)
IGNORED_SWITCHES = (
    "--trust-remote-code",
    "--enable-cache-report",
    "--disable-cuda-graph",
    "--enable-torch-compile",
    "--disable-overlap-schedule",
    "--enable-mixed-chunk",
    "--enable-p2p-check",
    "--enable-deterministic-inference",
)


@dataclass(frozen=True)
class SglangArgs:
    model_path: str
    host: str
    port: int
    api_key: str | None
    admin_api_key: str | None
    served_model_name: str
    context_length: int
    mem_fraction_static: float
    max_running_requests: int
    enable_memory_saver: bool
    enable_weights_cpu_backup: bool
    enable_metrics: bool
    tool_call_parser: str | None
    reasoning_parser: str | None
    tokenizer_worker_num: int
    disable_radix_cache: bool
    skip_server_warmup: bool
    log_requests: bool
    tp_size: int
    enable_lmcache: bool
    lmcache_config_file: str | None
    enable_hierarchical_cache: bool
    page_size: int
    chat_template: str | None
    speculative_algorithm: str | None
    allow_auto_truncate: bool
    is_embedding: bool  # an embedding or rerank model: /v1/embeddings and /v1/rerank answer


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    add = parser.add_argument
    add("--model-path", "--model", dest="model_path", required=True)
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--api-key")
    add("--admin-api-key")
    add("--served-model-name")
    add("--context-length", type=int)
    add("--mem-fraction-static", type=float, default=0.88)
    add("--max-running-requests", type=int, default=128)
    add("--tool-call-parser")
    add("--reasoning-parser", choices=REASONING_PARSERS)
    add("--tokenizer-worker-num", type=int, default=1)
    add("--tp", "--tp-size", dest="tp_size", type=int, default=1)
    add("--lmcache-config-file")
    add("--page-size", type=int, default=1)
    add("--chat-template")
    add("--speculative-algorithm")
    switches = (
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
        "--enable-metrics",
        "--disable-radix-cache",
        "--skip-server-warmup",
        "--log-requests",
        "--enable-lmcache",
        "--enable-hierarchical-cache",
        "--allow-auto-truncate",
        "--is-embedding",
        *IGNORED_SWITCHES,
    )
    proc.accept_flags(parser, switches, IGNORED_VALUES)
    return parser


def parse(argv: Sequence[str], prog: str) -> SglangArgs:
    ns = build_parser(prog).parse_args(argv)
    return proc.as_parsed(
        SglangArgs,
        ns,
        served_model_name=ns.served_model_name or ns.model_path,
        context_length=ns.context_length or 4096,
    )


def cli_main(argv: Sequence[str], version: str, behaviour: Behaviour) -> int:
    """The `sglang` console script: `sglang serve --model-path M [options]`, `sglang version`."""
    if argv[:1] in (["version"], ["--version"]):
        print(f"sglang {version}")
        return 0
    top = argparse.ArgumentParser(prog="sglang")
    top.add_argument("subcommand", choices=["serve"])
    top.parse_args(argv[:1])
    return main(argv[1:], version, behaviour, prog="sglang serve")


def main(
    argv: Sequence[str], version: str, behaviour: Behaviour, prog: str = "launch_server.py"
) -> int:
    args = parse(argv, prog)
    proc.configure_logging("[%(asctime)s] %(message)s", sys.stderr, "%Y-%m-%d %H:%M:%S")
    return proc.run(lambda process: _start(process, args, version, behaviour))


def _shared_memory(process: Process, args: SglangArgs) -> None:
    """With several tokenizer workers the launch args go to them through /dev/shm."""
    if args.tokenizer_worker_num <= 1:
        return
    segment = SHM_DIR / f"multi_tokenizer_args_{os.getpid()}"
    segment.write_bytes(repr(args).encode())
    process.at_exit(lambda: segment.unlink(missing_ok=True))


def plan_memory(
    process: Process,
    args: SglangArgs,
    holder: Holder,
    behaviour: Behaviour,
    devices: list[SimDevice] | None,
) -> Regions:
    """What each rank holds: its share of the weights, then CUDA graphs and the KV cache out
    of its static budget, sized by the least memory free on any rank's device."""
    weights = per_rank(weight_bytes(Path(args.model_path)), args.tp_size)
    if devices is None:
        return Regions.of(holder, {"weights": weights, "kv_cache": 0, "cuda_graph": 0}, behaviour)
    free = min(device.free_bytes(exclude={os.getpid()}) for device in devices)
    rest = int(args.mem_fraction_static * free) - weights
    if rest <= 0:
        process.die(
            "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."
        )
    graphs = min(256 * MIB, rest // 4)
    sizes = {"weights": weights, "kv_cache": rest - graphs, "cuda_graph": graphs}
    return Regions.of(holder, sizes, behaviour)


def _holder(
    process: Process, tp: int, devices: list[SimDevice] | None, behaviour: Behaviour
) -> Holder:
    """Who holds the memory: this process (one rank, with real device memory behind it in
    the CUDA mode), or a scheduler child per rank, whose death stops the server."""
    lag = behaviour.memory_lag_seconds
    if tp == 1:
        holder: Holder = NoHolder() if devices is None else LocalHolder(devices[0], lag)
        return with_cuda(process, holder)
    placed: Sequence[SimDevice | None] = devices if devices is not None else [None] * tp
    schedulers = Ranks(SCHEDULER_TITLE, placed, lag)
    loop = asyncio.get_running_loop()

    def died(rank: int, code: int) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is gone
            loop.call_soon_threadsafe(_child_died, process)

    schedulers.watch(died)
    return schedulers


def _child_died(process: Process) -> None:
    """A scheduler died on its own: the server kills its tree and exits, as SGLang's SIGQUIT
    handler does (unless the server is stopping: a group's SIGTERM reached them all)."""
    if not process.stop.is_set():
        process.die(CHILD_FAILED)


def _heads_refusal(tp: int) -> Callable[[int], str]:
    return lambda heads: (
        f"AssertionError: num_attention_heads ({heads}) must be divisible by tp_size ({tp})\n"
        + CHILD_FAILED
    )


def _ordinal_refusal(tp: int, visible: int) -> str:
    return (
        f"RuntimeError: CUDA error: invalid device ordinal (--tp-size {tp} needs {tp} GPUs, "
        f"{visible} visible)\n{CHILD_FAILED}"
    )


def _kill_rank(process: Process, holder: Holder) -> Callable[[int, int, str], None]:
    """How the `rank_dies` fault kills a rank: its scheduler child, or (one rank) this
    process, whose scheduler it stands for."""

    def kill(rank: int, code: int, message: str) -> None:
        said = f"Scheduler hit an exception: {message}"
        if isinstance(holder, Ranks):
            holder.kill_rank(rank, code, said)
        else:
            process.die(f"{said}\n{CHILD_FAILED}", code)

    return kill


def _prometheus_dir(process: Process) -> None:
    """SGLang's `set_prometheus_multiproc_dir`, removed when this process exits."""
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    folder = tempfile.TemporaryDirectory(dir=given)
    if given is None:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder.name
    process.at_exit(folder.cleanup)


# What Python 3.12 prints as such a server exits with its children gone.
RESOURCE_TRACKER_NOISE = "\n".join(
    (
        "Exception ignored in: <function ResourceTracker.__del__ at 0x7f3a2c1b2a20>",
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3.12/multiprocessing/resource_tracker.py", line 82, in __del__',
        '  File "/usr/lib/python3.12/multiprocessing/resource_tracker.py", line 91, in _stop',
        "ChildProcessError: [Errno 10] No child processes",
    )
)


async def _scheduler_dies(process: Process, dies: SchedulerDies) -> int:
    """The scheduler child dies while loading; this server, which maps the scheduler's load
    segment as the tokenizer manager does, waits on without listening until it is stopped."""
    loads = f"sglang_loads_tmp{secrets.token_hex(4)}_{secrets.token_hex(4)}.shm"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    module = [sys.executable, "-m", "enginesim.sglang_children"]
    died = [str(dies.after_seconds), str(dies.exit_code), dies.message]
    roles = (["scheduler", loads, *died], ["detokenizer"])
    children = [subprocess.Popen([*module, *role], env=env) for role in roles]

    def reap() -> None:
        for child in children:
            child.poll()

    process.at_exit(reap)
    process.at_exit(lambda: print(RESOURCE_TRACKER_NOISE, file=sys.stderr, flush=True))
    for _ in range(50):
        if (SHM_DIR / loads).exists():
            fd = os.open(SHM_DIR / loads, os.O_RDONLY)
            process.at_exit(mmap.mmap(fd, 0, prot=mmap.PROT_READ).close)
            break
        await asyncio.sleep(0.1)
    await process.stop.wait()
    return 0


async def _connect_kv(
    process: Process, args: SglangArgs, behaviour: Behaviour, devices: list[SimDevice] | None
) -> KvConnector | None:
    """LMCache's radix cache connects to its server; no other cache does."""
    if not args.enable_lmcache or args.disable_radix_cache or args.enable_hierarchical_cache:
        return None
    try:
        server = kvconnector.sglang_kv_server(args.lmcache_config_file, os.environ)
    except KvConfigError as exc:
        process.die(str(exc))
    kvconnector.require_module(process, "lmcache")
    if "PYTHONHASHSEED" not in os.environ:
        log.warning(
            "PYTHONHASHSEED is not set: LMCache's chunk hashes change with every process, so "
            "a restarted engine misses what it stored before"
        )
    gpu_ids = [device.device.index for device in devices] if devices is not None else [0]
    kv = await kvconnector.connect(process, server, "sglang", gpu_ids, behaviour.kv_connect_seconds)
    if kv is not None and kv.chunk_size % args.page_size:
        process.die(
            f"AssertionError: LMCache's chunk size {kv.chunk_size} is not a multiple of the "
            f"page size {args.page_size}"
        )
    return kv


def _check_decisions(process: Process, args: SglangArgs) -> None:
    """A decision checkpoint with LMCache and no radix cache fails (sgl-project/sglang#45929)."""
    decision = decisions.hf_checkpoint(Path(args.model_path)) != "chat"
    if decision and args.enable_lmcache and args.disable_radix_cache:
        process.die(
            "ValueError: --enable-lmcache cannot be used with --disable-radix-cache for a "
            "decision checkpoint: LMCache is a kind of radix cache"
        )


async def _start(process: Process, args: SglangArgs, version: str, behaviour: Behaviour) -> int:
    log.info("server_args=%s", args)
    _check_decisions(process, args)
    tp = args.tp_size
    ranks.check_heads(process, Path(args.model_path), tp, _heads_refusal(tp))
    _shared_memory(process, args)
    if args.enable_metrics:
        _prometheus_dir(process)
    devices = ranks.rank_devices(process, tp, cuda_devices(process), os.environ, _ordinal_refusal)
    holder = _holder(process, tp, devices, behaviour)
    process.at_exit(holder.close)
    regions = plan_memory(process, args, holder, behaviour, devices)
    regions.loading(regions.sizes["weights"])
    log.info("Load weight begin.")
    if behaviour.faults.scheduler_dies is not None:
        return await _scheduler_dies(process, behaviour.faults.scheduler_dies)
    if not await finish_loading(process, behaviour, regions):
        return 0
    log.info("Load weight end.")
    kv = await _connect_kv(process, args, behaviour, devices)
    if process.stop.is_set():
        return 0
    try:
        sock = proc.open_socket(args.host, args.port, reuse_port=False)
    except OSError as exc:
        process.die(f"ERROR:    [Errno {exc.errno}] error while attempting to bind: {exc}")
    process.at_exit(sock.close)
    frontend = SglangFrontend(args, version, behaviour, process, regions, kv)
    app = build_app(frontend)
    process.spawn(frontend.warm_up())
    frontend.arm_death()
    ranks.arm_rank_death(process, behaviour, tp, _kill_rank(process, holder))
    await proc.serve(
        app, sock, process, frontend.shutdown, access_log=True, corked=behaviour.instant
    )
    return 0
