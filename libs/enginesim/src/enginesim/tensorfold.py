"""TensorFold's `tensorfold` command: its command line, its environment, start-up.

This imitates what CapyCTL assumes about TensorFold, not a verified engine: TensorFold's
command line is not public, so every flag, variable, message and route here is CapyCTL's
assumption of its shape, and the simulator implements exactly that assumption.

`tensorfold --version` prints `tensorfold <version>`. `tensorfold serve --model FOLDER
--context-length N [--host H] [--port P] [--served-model-name NAME] [--parallel N]
[--max-tokens N] [--thinking on|off]` serves the model folder (only long options; a missing
`--context-length` or an unknown option is argparse's error, exit 2).

Its environment: `TENSORFOLD_API_KEY` guards every route but `GET /health` with a bearer
key; `TENSORFOLD_CUDA_MEMORY_LIMIT_GB` caps what it takes on its GPU (see
`enginesim.tensorfold_app`); unless `TENSORFOLD_NO_UPDATE_CHECK=1` it says it checks for
updates at start (the simulator does no network I/O).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import NoReturn

from enginesim import process as proc
from enginesim.behaviour import Behaviour
from enginesim.gpu import GIB
from enginesim.process import Process
from enginesim.tensorfold_app import TensorFoldFrontend, build_app

PROG = "tensorfold"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_PARALLEL = 8
API_KEY_ENV = "TENSORFOLD_API_KEY"
MEMORY_LIMIT_ENV = "TENSORFOLD_CUDA_MEMORY_LIMIT_GB"
NO_UPDATE_CHECK_ENV = "TENSORFOLD_NO_UPDATE_CHECK"
UPDATE_CHECK_LINE = "tensorfold: checking for updates at https://updates.tensorfold.ai/check"

log = logging.getLogger("tensorfold")


@dataclass(frozen=True)
class TensorFoldArgs:
    model: str
    host: str
    port: int
    served_model_name: str
    context_length: int
    parallel: int
    max_tokens: int | None
    thinking: str
    api_key: str | None
    # The cap on the GPU memory it takes, in bytes, and as the variable gave it.
    memory_limit: int | None
    memory_limit_text: str | None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer value: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port: {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"port out of range: {value}")
    return value


def build_parser(version: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, add_help=False)
    parser.add_argument("--help", action="help", help="show this help and exit")
    parser.add_argument("--version", action="version", version=f"{PROG} {version}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve}")
    serve = commands.add_parser(
        "serve", allow_abbrev=False, add_help=False, help="serve a model over HTTP"
    )
    add = serve.add_argument
    add("--help", action="help", help="show this help and exit")
    add("--model", required=True, help="the model folder (its *.safetensors are the weights)")
    add("--host", default=DEFAULT_HOST)
    add("--port", type=_port, default=DEFAULT_PORT)
    add("--served-model-name", help="the name clients ask for (default: the model path)")
    add("--context-length", type=_positive, required=True)
    add("--parallel", type=_positive, default=DEFAULT_PARALLEL)
    add("--max-tokens", type=_positive)
    add("--thinking", choices=("on", "off"), default="off")
    return parser


def _refuse(message: str) -> NoReturn:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    raise SystemExit(2)


def memory_limit(env: Mapping[str, str]) -> tuple[int, str] | None:
    """(bytes, the text) of TENSORFOLD_CUDA_MEMORY_LIMIT_GB, or None without it; a value that
    is not a positive number of GiB is an exit 2 naming the variable."""
    text = env.get(MEMORY_LIMIT_ENV)
    if text is None:
        return None
    try:
        gib = Decimal(text.strip())
    except InvalidOperation:
        _refuse(f"{MEMORY_LIMIT_ENV} must be a number of GiB, got {text!r}")
    if not gib.is_finite() or gib <= 0:
        _refuse(f"{MEMORY_LIMIT_ENV} must be a positive number of GiB, got {text!r}")
    return int(gib * GIB), text


def parse(argv: Sequence[str], version: str, env: Mapping[str, str]) -> TensorFoldArgs:
    ns = build_parser(version).parse_args(argv)
    limit = memory_limit(env)
    return TensorFoldArgs(
        model=ns.model,
        host=ns.host,
        port=ns.port,
        served_model_name=ns.served_model_name or ns.model,
        context_length=ns.context_length,
        parallel=ns.parallel,
        max_tokens=ns.max_tokens,
        thinking=ns.thinking,
        api_key=env.get(API_KEY_ENV) or None,
        memory_limit=limit[0] if limit else None,
        memory_limit_text=limit[1] if limit else None,
    )


def main(argv: Sequence[str], version: str, behaviour: Behaviour) -> int:
    args = parse(argv, version, os.environ)
    proc.configure_logging("%(message)s", sys.stderr)
    return proc.run(lambda process: _start(process, args, version, behaviour))


async def _start(process: Process, args: TensorFoldArgs, version: str, behaviour: Behaviour) -> int:
    log.info(f"tensorfold {version}: serving {args.model} as {args.served_model_name!r}")
    if os.environ.get(NO_UPDATE_CHECK_ENV) != "1":
        log.info(UPDATE_CHECK_LINE)
    front = TensorFoldFrontend(args, behaviour, process)
    try:
        sock = proc.open_socket(args.host, args.port, reuse_port=False)
    except OSError as exc:
        process.die(f"tensorfold: error: cannot listen on {args.host}:{args.port}: {exc}")
    process.at_exit(sock.close)
    app = build_app(front)
    process.spawn(front.load())
    log.info(f"tensorfold: listening on http://{args.host}:{args.port}")
    await proc.serve(app, sock, process, front.shutdown, access_log=False, corked=behaviour.instant)
    log.info("tensorfold: stopped")
    return 0
