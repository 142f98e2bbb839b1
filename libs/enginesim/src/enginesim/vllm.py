"""vLLM's launch: `vllm serve M` or `python -m vllm.entrypoints.openai.api_server --model M`.

Start-up as vLLM does it: the socket is bound (SO_REUSEPORT) but not listening while the
EngineCore child loads, so clients are refused; the child holds the device memory. Then
`Starting vLLM server on http://HOST:PORT`, and uvicorn's `Application startup complete.`.
Memory: the budget is --gpu-memory-utilization x the device's total; the weights are the
model folder's weight files; the KV cache is the rest of the budget, or exactly
--kv-cache-memory-bytes when given.

With --tensor-parallel-size (-tp) N > 1 the EngineCore holds nothing itself: it starts N
`VLLM::Worker_TP<i>` children, rank i on the i-th visible device, each holding the weights / N
and its own KV cache (--gpu-memory-utilization and --kv-cache-memory-bytes are per GPU; the KV
cache is the smallest any device leaves), see `enginesim.ranks`. Sleep and wake move every
rank's memory. Refused at start as vLLM refuses: a model whose `num_attention_heads`
(config.json) N does not divide, and more ranks than visible devices.

`--kv-transfer-config` with LMCache's `LMCacheMPConnector` (LMCache's own module named by
`kv_connector_module_path`, or vLLM's built-in copy, which imports `lmcache` too) connects to
the LMCache server once loaded and registers the device's index before the server listens;
see `enginesim.kvconnector`. vLLM's other connectors are accepted and do nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from enginesim import kvconnector, ranks
from enginesim import process as proc
from enginesim.behaviour import Behaviour
from enginesim.gpu import SimDevice, cuda_devices, gib
from enginesim.kvconnector import KvConfigError, KvConnector, VllmKvConfig
from enginesim.memory import Regions, finish_loading, weight_bytes
from enginesim.parallel import per_rank
from enginesim.process import Process
from enginesim.ranks import ChildHolder
from enginesim.vllm_app import VllmFrontend, build_app

log = logging.getLogger("vllm.entrypoints.openai.api_server")

LOG_FORMAT = "%(levelname)s %(asctime)s [api_server.py] %(message)s"
REASONING_PARSERS = frozenset(
    {
        "deepseek_r1",
        "deepseek_v3",
        "qwen3",
        "glm45",
        "openai_gptoss",
        "kimi_k2",
        "minimax_m2",
        "minimax_m2_append_think",
        "granite",
        "hunyuan_a13b",
        "mistral",
        "step3",
        "seed_oss",
        "ernie45",
        "olmo3",
        "gptoss",
        "holo2",
    }
)
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# Accepted and ignored: flags that change nothing the simulator shows ("|" joins aliases).
IGNORED_VALUES = (
    "--dtype",
    "--pipeline-parallel-size|-pp",
    "--data-parallel-size|-dp",
    "--uvicorn-log-level",
    "--root-path",
    "--allowed-origins",
    "--quantization|-q",
    "--tokenizer",
    "--revision",
    "--download-dir",
    "--load-format",
    "--chat-template",
    "--generation-config",
    "--seed",
    "--max-num-batched-tokens",
    "--show-hidden-metrics-for-version",
    "--api-server-count|-asc",
    "--config",
    "--tool-parser-plugin",
    "--swap-space",
    "--block-size",
    "--compilation-config",
    "--limit-mm-per-prompt",
    "--hf-overrides",
    "--override-generation-config",
)
IGNORED_SWITCHES = (
    "--trust-remote-code",
    "--enforce-eager",
    "--enable-log-requests",
    "--disable-log-requests",
    "--disable-log-stats",
    "--enable-prompt-tokens-details",
    "--disable-fastapi-docs",
    "--headless",
    "--enable-chunked-prefill",
    "--disable-custom-all-reduce",
)


@dataclass(frozen=True)
class VllmArgs:
    model: str
    host: str | None
    port: int
    served_names: list[str]
    api_keys: list[str]
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    enable_sleep_mode: bool
    kv_cache_memory_bytes: int | None
    enable_auto_tool_choice: bool
    tool_call_parser: str | None
    reasoning_parser: str | None
    enable_request_id_headers: bool
    disable_uvicorn_access_log: bool
    middleware: list[str]
    shutdown_timeout: float
    enable_force_include_usage: bool
    enable_server_load_tracking: bool
    kv_transfer_config: VllmKvConfig | None
    logprobs_mode: str
    tensor_parallel_size: int


def human_int(text: str) -> int:
    """vLLM's human-readable ints: 1k = 1000, 1K = 1024 (likewise m/M, g/G)."""
    factors = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in factors:
        return int(float(text[:-1]) * factors[text[-1]])
    return int(text)


def build_parser(prog: str, positional_model: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    add = parser.add_argument
    if positional_model:
        add("model_tag", nargs="?")
    add("--model", default="Qwen/Qwen3-0.6B")
    add("--host")
    add("--port", type=int, default=8000)
    add("--served-model-name", nargs="+", action="extend")
    add("--api-key", nargs="+", action="extend")
    add("--gpu-memory-utilization", type=float, default=0.9)
    add("--max-model-len", type=human_int, default=4096)
    add("--max-num-seqs", type=int, default=256)
    add("--kv-cache-memory-bytes", type=human_int)
    add("--tool-call-parser")
    add("--reasoning-parser")
    add("--middleware", action="append", default=[])
    add("--shutdown-timeout", type=float, default=0.0)
    add("--kv-transfer-config")
    add("--logprobs-mode", choices=LOGPROBS_MODES, default="raw_logprobs")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    add("--tensor-parallel-size", "-tp", type=int, default=1)
    switches = (
        "--enable-sleep-mode",
        "--enable-auto-tool-choice",
        "--enable-request-id-headers",
        "--disable-uvicorn-access-log",
        "--enable-force-include-usage",
        "--enable-server-load-tracking",
        *IGNORED_SWITCHES,
    )
    proc.accept_flags(parser, switches, IGNORED_VALUES)
    return parser


def parse(argv: Sequence[str], prog: str, positional_model: bool) -> VllmArgs:
    parser = build_parser(prog, positional_model)
    ns = parser.parse_args(argv)
    model: str = getattr(ns, "model_tag", None) or ns.model
    kv = None
    if ns.kv_transfer_config is not None:
        try:
            kv = kvconnector.vllm_kv_config(ns.kv_transfer_config)
        except KvConfigError as exc:
            parser.error(f"argument --kv-transfer-config: {exc}")
    if ns.tensor_parallel_size < 1:
        parser.error("argument --tensor-parallel-size/-tp: must be at least 1")
    keys = ns.api_key or ([os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else [])
    return proc.as_parsed(
        VllmArgs,
        ns,
        model=model,
        served_names=ns.served_model_name or [model],
        api_keys=keys,
        kv_transfer_config=kv,
    )


def cli_main(argv: Sequence[str], version: str, behaviour: Behaviour) -> int:
    """The `vllm` console script: `vllm serve [MODEL] [options]`, `vllm --version`."""
    if argv[:1] in (["--version"], ["-v"]):
        print(version)
        return 0
    top = argparse.ArgumentParser(prog="vllm")
    top.add_argument("subcommand", choices=["serve"])
    top.parse_args(argv[:1])
    return main(argv[1:], version, behaviour, prog="vllm serve", positional_model=True)


def main(
    argv: Sequence[str],
    version: str,
    behaviour: Behaviour,
    prog: str = "api_server.py",
    positional_model: bool = False,
) -> int:
    args = parse(argv, prog, positional_model)
    proc.configure_logging(LOG_FORMAT, sys.stdout)
    return proc.run(lambda process: _start(process, args, version, behaviour))


def _check(process: Process, args: VllmArgs) -> bool:
    """vLLM's start-up refusals; returns dev mode (VLLM_SERVER_DEV_MODE as bool(int(v)))."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        process.die("TypeError: Error: --enable-auto-tool-choice requires --tool-call-parser")
    if args.reasoning_parser and args.reasoning_parser not in REASONING_PARSERS:
        process.die(
            f"KeyError: \"reasoning helper: '{args.reasoning_parser}' not found in "
            'reasoning_parser"'
        )
    try:
        return bool(int(os.environ.get("VLLM_SERVER_DEV_MODE", "0")))
    except ValueError as exc:
        process.die(f"ValueError: {exc}")


def plan_memory(
    process: Process,
    args: VllmArgs,
    devices: list[SimDevice] | None,
    child: ChildHolder,
    behaviour: Behaviour,
) -> Regions:
    """What each rank holds: its share of the weights and its KV cache, which the smallest
    room any rank's device leaves sizes (or --kv-cache-memory-bytes, per GPU)."""
    weights = per_rank(weight_bytes(Path(args.model)), args.tensor_parallel_size)
    if devices is None:
        sizes = {"weights": weights, "kv_cache": args.kv_cache_memory_bytes or 0}
        return Regions.of(child, sizes, behaviour)
    rooms = [
        _room(process, args, index, device, child.pid, behaviour)
        for index, device in enumerate(devices)
    ]
    kv = args.kv_cache_memory_bytes or min(budget for budget, _ in rooms) - weights
    if kv <= 0 or any(weights + kv > free for _, free in rooms):
        process.die(
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine."
        )
    return Regions.of(child, {"weights": weights, "kv_cache": kv}, behaviour)


def _room(
    process: Process,
    args: VllmArgs,
    index: int,
    device: SimDevice,
    core: int,
    behaviour: Behaviour,
) -> tuple[int, int]:
    """GPU `index`'s budget and free bytes, refused as vLLM refuses a budget that does not
    fit (what this process and its EngineCore `core` claim counts as free)."""
    budget = int(args.gpu_memory_utilization * device.total)
    free = device.free_bytes(exclude={os.getpid(), core})
    extra = behaviour.startup_extra_bytes
    if extra and free < budget + extra:
        process.die(
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {gib(extra)} GiB. "
            f"GPU {index} has a total capacity of {gib(device.total)} GiB of which {gib(free)} "
            "GiB is free."
        )
    if free < budget:
        process.die(
            f"ValueError: Free memory on device ({gib(free)}/{gib(device.total)} GiB) on startup "
            f"is less than desired GPU memory utilization ({args.gpu_memory_utilization}, "
            f"{gib(budget)} GiB). Decrease GPU memory utilization or reduce GPU memory used by "
            "other processes."
        )
    return budget, free


def _heads_refusal(tp: int) -> Callable[[int], str]:
    return lambda heads: (
        f"ValueError: Total number of attention heads ({heads}) must be divisible by tensor "
        f"parallel size ({tp})."
    )


def _world_refusal(world: int, visible: int) -> str:
    return (
        f"RuntimeError: world_size ({world}) is greater than the number of available GPUs "
        f"({visible}): --tensor-parallel-size {world} needs one GPU per rank\n"
        "RuntimeError: Engine core initialization failed. See root cause above."
    )


def _engine_core(
    args: VllmArgs, devices: list[SimDevice] | None, behaviour: Behaviour
) -> ChildHolder:
    """The EngineCore child, holding the memory itself (one rank) or through its workers."""
    stays = behaviour.faults.leave_child_on_sigkill
    core = ["--lag", str(behaviour.memory_lag_seconds), "--orphan", "stay" if stays else "exit"]
    core += ["--ranks", str(args.tensor_parallel_size)]
    if devices is not None:
        core += ["--dir", str(devices[0].folder)]
        core += ["--uuid", ",".join(device.device.uuid for device in devices)]
    return ChildHolder("VLLM::EngineCore", "enginesim.enginecore", core)


async def _start(process: Process, args: VllmArgs, version: str, behaviour: Behaviour) -> int:
    log.info("vLLM API server version %s", version)
    log.info("args: %s", args)
    dev_mode = _check(process, args)
    host = args.host or "0.0.0.0"
    try:
        sock = proc.open_socket(host, args.port, reuse_port=True)
    except OSError as exc:
        process.die(f"OSError: {exc}")
    process.at_exit(sock.close)
    tp = args.tensor_parallel_size
    ranks.check_heads(process, Path(args.model), tp, _heads_refusal(tp))
    devices = ranks.rank_devices(process, tp, cuda_devices(process), os.environ, _world_refusal)
    child = _engine_core(args, devices, behaviour)
    process.at_exit(child.close)
    regions = plan_memory(process, args, devices, child, behaviour)
    extra = behaviour.startup_extra_bytes
    regions.loading(regions.full + extra if extra else regions.sizes["weights"])
    if not await finish_loading(process, behaviour, regions):
        return 0
    kv = await _connect_kv(process, args.kv_transfer_config, behaviour, devices)
    if process.stop.is_set():
        return 0
    frontend = VllmFrontend(args, version, behaviour, process, regions, dev_mode, kv)
    app = build_app(frontend)
    _watch_child(process, child, frontend)
    frontend.arm_death()
    ranks.arm_rank_death(process, behaviour, tp, child.kill_rank)
    log.info("Starting vLLM server on http://%s:%d", host, args.port)
    log.info("Available routes are: %s", ", ".join(sorted(frontend.paths(app))))
    await proc.serve(
        app,
        sock,
        process,
        frontend.shutdown,
        not args.disable_uvicorn_access_log,
        corked=behaviour.instant,
    )
    return 0


async def _connect_kv(
    process: Process,
    config: VllmKvConfig | None,
    behaviour: Behaviour,
    devices: list[SimDevice] | None,
) -> KvConnector | None:
    """The KV connector, once the model is loaded: LMCache's connects to its server and
    registers every rank's device."""
    if config is None:
        return None
    if config.server is None:
        log.info("KV connector %s: accepted, not simulated", config.connector)
        return None
    if config.autostart:
        process.die(
            "ValueError: lmcache.mp.autostart is not simulated; start the LMCache server "
            "first and pass lmcache.mp.autostart: false"
        )
    if config.module_path is None:
        log.info("Using vLLM's built-in %s", config.connector)
    else:
        log.info("Using %s from %s", config.connector, config.module_path)
    kvconnector.require_module(process, config.module_path or "lmcache")
    gpu_ids = [device.device.index for device in devices] if devices is not None else [0]
    return await kvconnector.connect(
        process, config.server, "vllm", gpu_ids, behaviour.kv_connect_seconds
    )


def _watch_child(process: Process, child: ChildHolder, frontend: VllmFrontend) -> None:
    """The EngineCore dying on its own kills the engine, as vLLM's API server notices."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(child.pid)
    except OSError:  # a kernel without pidfd (before 5.3): the death goes unnoticed
        return

    def forget() -> None:
        loop.remove_reader(fd)
        os.close(fd)

    def gone() -> None:
        loop.remove_reader(fd)
        if not process.stopping and not process.stop.is_set():
            frontend.fatal("Engine core proc EngineCore_DP0 died unexpectedly, shutting down.")

    loop.add_reader(fd, gone)
    process.at_exit(forget)
