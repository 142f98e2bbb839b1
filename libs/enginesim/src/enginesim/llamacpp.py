"""llama.cpp's `llama-server`: flags (and their LLAMA_ARG_* variables), start-up, memory.

It listens at once; `/health` answers 503 `Loading model` until the model is loaded. The
build number decides the default port: 8080 before build 6900, 9931 from it on; builds
6800-6899 print the NOTICE about the change when --port is not given. An unknown flag is
`error: invalid argument: X`, exit 1, as llama.cpp's own parser does. --embeddings,
--reranking (embeddings with rank pooling), --pooling and --mmproj decide whether embeddings,
rerank and transcriptions are answered (`enginesim.pooling_api`, `enginesim.audio_api`).

Memory with a simulated GPU: the GGUF file's size plus a KV estimate of
ctx_size x 128 KiB (f16 K and V for 32 layers x 8 KV heads x 128 dims) plus 8 MiB of compute
buffers per slot; with -ngl 0 everything stays in host RAM. The one process uses every visible
device: with --split-mode layer (the default) or row it splits all of it over them by the
--tensor-split proportions (`3,1` or `3/1`; missing ones are 0, and none given or all 0 split
it equally), holding it in one claim whose `also` names the other devices; with --split-mode
none only --main-gpu (default 0) holds it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from enginesim import process as proc
from enginesim.behaviour import Behaviour
from enginesim.llamacpp_app import LlamaFrontend, build_app, commit_of
from enginesim.process import Process

NOTICE_FROM_BUILD = 6800
NEW_PORT_FROM_BUILD = 6900
DEFAULT_SLOTS = 4
# flag -> its environment variable; a flag on the command line wins over the variable.
ENV_NAMES = {
    "model": "LLAMA_ARG_MODEL",
    "host": "LLAMA_ARG_HOST",
    "port": "LLAMA_ARG_PORT",
    "api_key": "LLAMA_API_KEY",
    "ctx_size": "LLAMA_ARG_CTX_SIZE",
    "parallel": "LLAMA_ARG_N_PARALLEL",
    "slots": "LLAMA_ARG_ENDPOINT_SLOTS",
    "metrics": "LLAMA_ARG_ENDPOINT_METRICS",
    "jinja": "LLAMA_ARG_JINJA",
    "alias": "LLAMA_ARG_ALIAS",
    "reasoning_format": "LLAMA_ARG_THINK",
    "n_gpu_layers": "LLAMA_ARG_N_GPU_LAYERS",
    "no_webui": "LLAMA_ARG_NO_WEBUI",
    "sleep_idle_seconds": "LLAMA_ARG_SLEEP_IDLE_SECONDS",
    "batch_size": "LLAMA_ARG_BATCH",
    "ubatch_size": "LLAMA_ARG_UBATCH",
    "split_mode": "LLAMA_ARG_SPLIT_MODE",
    "tensor_split": "LLAMA_ARG_TENSOR_SPLIT",
    "main_gpu": "LLAMA_ARG_MAIN_GPU",
    "embeddings": "LLAMA_ARG_EMBEDDINGS",
    "reranking": "LLAMA_ARG_RERANKING",
    "pooling": "LLAMA_ARG_POOLING",
    "mmproj": "LLAMA_ARG_MMPROJ",
}
BOOLEANS = frozenset({"slots", "metrics", "jinja", "no_webui", "embeddings", "reranking"})
# Accepted and ignored ("|" joins aliases).
IGNORED_VALUES = (
    "-t|--threads",
    "--temp",
    "--top-p",
    "--top-k",
    "--min-p",
    "-n|--n-predict",
    "-ctk|--cache-type-k",
    "-ctv|--cache-type-v",
    "-fa|--flash-attn",
    "--log-file",
    "--fit",
    "-s|--seed",
    "--chat-template",
    "--chat-template-file",
    "-to|--timeout",
    "--sse-ping-interval",
    "--reasoning-budget",
    "--api-key-file",
    "-ncmoe|--n-cpu-moe",
    "--numa",
    "-dt",
    "--cache-reuse",
    "-hf|--hf-repo",
    "--path",
)
IGNORED_SWITCHES = (
    "--mlock",
    "--no-mmap",
    "-cb|--cont-batching",
    "--kv-unified",
    "-v|--verbose",
    "--log-disable",
    "--no-warmup",
    "--props",
    "--webui",
)


@dataclass(frozen=True)
class LlamaArgs:
    model: str
    host: str
    port: int
    port_given: bool
    api_keys: list[str]
    ctx_size: int
    parallel: int
    slots: bool
    metrics: bool
    jinja: bool
    alias: str | None
    reasoning_format: str
    n_gpu_layers: str
    no_webui: bool
    sleep_idle_seconds: int
    batch_size: int
    ubatch_size: int
    split_mode: str
    tensor_split: tuple[float, ...]
    main_gpu: int
    embeddings: bool  # --embeddings, or --reranking
    pooling: str | None  # "rank" with --reranking; None: the model's own
    mmproj: str | None  # a multimodal projector (an audio one, for transcriptions)


def version_text(build: int) -> str:
    return (
        f"version: {build} ({commit_of(build)})\n"
        "built with cc (Ubuntu 13.3.0-6ubuntu2~24.04) 13.3.0 for x86_64-linux-gnu\n"
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(1)


def proportions(text: str) -> tuple[float, ...]:
    """llama.cpp's --tensor-split: non-negative proportions parted by `,` or `/`."""
    try:
        found = tuple(float(part) for part in re.split(r"[,/]+", text.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid proportions {text!r}") from None
    if any(part < 0 or not math.isfinite(part) for part in found):
        raise argparse.ArgumentTypeError(f"invalid proportions {text!r}")
    return found


def _truthy(value: str) -> bool:
    return value.lower() in ("1", "true", "on", "enabled", "yes")


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="llama-server", add_help=True)
    add = parser.add_argument
    add("-m", "--model", default="models/7B/ggml-model-f16.gguf")
    add("--host", default="127.0.0.1")
    add("--port", type=int)
    add("--api-key")
    add("-c", "--ctx-size", type=int, default=4096)
    add("-np", "--parallel", type=int, default=-1)
    add("--slots", action=argparse.BooleanOptionalAction, default=True)
    add("--metrics", action="store_true")
    add("--jinja", action=argparse.BooleanOptionalAction, default=True)
    add("-a", "--alias")
    add(
        "--reasoning-format",
        choices=("none", "deepseek", "deepseek-legacy", "auto"),
        default="auto",
    )
    add("-ngl", "--n-gpu-layers", "--gpu-layers", default="auto")
    add("--no-webui", action="store_true")
    add("--sleep-idle-seconds", type=int, default=-1)
    add("-b", "--batch-size", type=int, default=2048)
    add("-ub", "--ubatch-size", type=int, default=512)
    add("-sm", "--split-mode", choices=("none", "layer", "row"), default="layer")
    add("-ts", "--tensor-split", type=proportions, default=())
    add("-mg", "--main-gpu", type=int, default=0)
    add("--embedding", "--embeddings", dest="embeddings", action="store_true")
    add("--reranking", "--rerank", dest="reranking", action="store_true")
    add("--pooling", choices=("none", "mean", "cls", "last", "rank"))
    add("-mm", "--mmproj")
    for flag in IGNORED_VALUES:
        add(*flag.split("|"))
    for switch in IGNORED_SWITCHES:
        add(*switch.split("|"), action="store_true")
    defaults: dict[str, object] = {}
    for dest, variable in ENV_NAMES.items():
        if variable in env:
            value = env[variable]
            defaults[dest] = _truthy(value) if dest in BOOLEANS else value
    parser.set_defaults(**defaults)
    return parser


def parse(argv: Sequence[str], build: int, env: Mapping[str, str]) -> LlamaArgs:
    ns, unknown = build_parser(env).parse_known_args(argv)
    if unknown:
        sys.stderr.write(f"error: invalid argument: {unknown[0]}\n")
        raise SystemExit(1)
    port = int(ns.port) if ns.port is not None else None
    default_port = 9931 if build >= NEW_PORT_FROM_BUILD else 8080
    keys = [key.strip() for key in (ns.api_key or "").split(",") if key.strip()]
    return LlamaArgs(
        model=ns.model,
        host=ns.host,
        port=port or default_port,
        port_given=port is not None,
        api_keys=keys,
        ctx_size=int(ns.ctx_size) or 4096,
        parallel=int(ns.parallel) if int(ns.parallel) > 0 else DEFAULT_SLOTS,
        slots=bool(ns.slots),
        metrics=bool(ns.metrics),
        jinja=bool(ns.jinja),
        alias=ns.alias,
        reasoning_format=ns.reasoning_format,
        n_gpu_layers=str(ns.n_gpu_layers),
        no_webui=bool(ns.no_webui),
        sleep_idle_seconds=int(ns.sleep_idle_seconds),
        batch_size=int(ns.batch_size),
        ubatch_size=int(ns.ubatch_size),
        split_mode=ns.split_mode,
        tensor_split=tuple(ns.tensor_split),
        main_gpu=int(ns.main_gpu),
        embeddings=bool(ns.embeddings or ns.reranking),
        pooling="rank" if ns.reranking else ns.pooling,
        mmproj=ns.mmproj,
    )


def main(argv: Sequence[str], build: int, behaviour: Behaviour) -> int:
    if "--version" in argv:
        sys.stderr.write(version_text(build))
        return 0
    args = parse(argv, build, os.environ)
    proc.configure_logging("%(message)s", sys.stderr)
    return proc.run(lambda process: _start(process, args, build, behaviour))


async def _start(process: Process, args: LlamaArgs, build: int, behaviour: Behaviour) -> int:
    front = LlamaFrontend(args, build, behaviour, process)
    front.say(f"build: {build} ({commit_of(build)}) with cc (Ubuntu 13.3.0) for x86_64-linux-gnu")
    if NOTICE_FROM_BUILD <= build < NEW_PORT_FROM_BUILD and not args.port_given:
        front.say("NOTICE: server default port will be changed to :9931 in a future release")
    front.say("main: binding port with default address family")
    try:
        sock = proc.open_socket(args.host, args.port, reuse_port=False)
    except OSError:
        process.die(f"couldn't bind HTTP server socket, hostname: {args.host}, port: {args.port}")
    process.at_exit(sock.close)
    app = build_app(front)
    process.spawn(front.load())
    await proc.serve(app, sock, process, front.shutdown, access_log=False, corked=behaviour.instant)
    return 0
