"""A `llama-server` for tests: llama.cpp's own HTTP server, run through xllamacpp.

xllamacpp's `Server` runs llama.cpp's server code, `server_http_context` and its routes
included, on threads inside this process: the socket listens before the model loads (so
`/health` answers 503 `Loading model`), the paths, the auth rules and the bodies are llama.cpp's.
What this program adds is what llama-server's `main()` does around it: parse the command line
(the flags CapyCTL's llamacpp adapter passes; any other flag fails with exit 1), read
`LLAMA_API_KEY`, exit 1 when the model does not load, and shut down cleanly, exit 0, on SIGTERM
or SIGINT. As in llama-server, a second signal during shutdown kills the process at once.

Run it as `python llama_server.py -m model.gguf --port 8080 ...`, or through the executable
`llama-server` wrapper that `write_wrapper()` creates.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NoReturn

import xllamacpp as xlc  # type: ignore[import-untyped]  # no stubs; its API is used below only

REASONING_FORMATS: Mapping[str, str] = {
    "none": "COMMON_REASONING_FORMAT_NONE",
    "auto": "COMMON_REASONING_FORMAT_AUTO",
    "deepseek": "COMMON_REASONING_FORMAT_DEEPSEEK",
    "deepseek-legacy": "COMMON_REASONING_FORMAT_DEEPSEEK_LEGACY",
}
GPU_LAYERS_WORDS: Mapping[str, int] = {"auto": -1, "all": -2}  # llama.cpp's -ngl sentinels
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


@dataclass(frozen=True)
class LaunchOptions:
    """The command line, parsed: the subset of llama-server's flags CapyCTL uses."""

    model: Path
    host: str
    port: int
    aliases: tuple[str, ...]
    ctx_size: int
    batch_size: int
    ubatch_size: int
    parallel: int
    metrics: bool
    webui: bool
    gpu_layers: int
    jinja: bool
    reasoning_format: str
    api_keys: tuple[str, ...]


class _Parser(argparse.ArgumentParser):
    """llama-server's answer to a bad command line: the message, then exit code 1."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(1, f"error: {message}\n")


def _gpu_layers(value: str) -> int:
    return GPU_LAYERS_WORDS[value] if value in GPU_LAYERS_WORDS else int(value)


def _comma_list(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def build_parser(prog: str = "llama-server") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, allow_abbrev=False, description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--version", action="store_true", help="print the llama.cpp build and exit")
    add("-m", "--model", type=Path, help="model path (GGUF)")
    add("--host", default="127.0.0.1", help="listen address(es), comma-separated")
    add("--port", type=int, default=8080)
    add("-a", "--alias", action="append", default=[], help="model name aliases, comma-separated")
    add("-c", "--ctx-size", type=int, default=0, help="context size (0 = from the model)")
    add("-b", "--batch-size", type=int, default=2048, help="logical batch size (tokens)")
    add("-ub", "--ubatch-size", type=int, default=512, help="physical batch size (tokens)")
    add("-np", "--parallel", type=int, default=-1, help="number of slots (-1 = auto)")
    add("--metrics", action="store_true", help="enable /metrics")
    add("--webui", dest="webui", action="store_true", default=True)
    add("--no-webui", dest="webui", action="store_false")
    add("-ngl", "--gpu-layers", "--n-gpu-layers", type=_gpu_layers, default=-1)
    add("--jinja", dest="jinja", action="store_true", default=True)
    add("--no-jinja", dest="jinja", action="store_false")
    add("--reasoning-format", choices=sorted(REASONING_FORMATS), default="auto")
    add("--api-key", type=_comma_list, default=(), help="API keys, comma-separated")
    return parser


def parse_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace, env: Mapping[str, str]
) -> LaunchOptions:
    """Turn parsed flags into options; `--api-key` wins over `LLAMA_API_KEY`, as in llama.cpp."""
    if args.model is None:
        parser.error("a model is required: -m FILE")
    keys: tuple[str, ...] = args.api_key or _comma_list(env.get("LLAMA_API_KEY", ""))
    aliases = tuple(a for value in args.alias for a in _comma_list(value))
    # Every other option is the flag of its name, as parsed.
    as_parsed = {
        name: getattr(args, name)
        for name in (f.name for f in fields(LaunchOptions))
        if name not in ("aliases", "api_keys")
    }
    return LaunchOptions(**as_parsed, aliases=aliases, api_keys=keys)


def build_params(options: LaunchOptions) -> Any:
    """The `xllamacpp.CommonParams` llama-server's own parser would have filled in."""
    params = xlc.CommonParams()
    params.model.path = str(options.model)
    params.hostnames = list(_comma_list(options.host))
    params.port = options.port
    if options.aliases:
        params.model_alias = set(options.aliases)
    params.n_ctx = options.ctx_size
    params.n_batch = options.batch_size
    params.n_ubatch = options.ubatch_size
    params.n_parallel = options.parallel
    params.endpoint_metrics = options.metrics
    params.ui = options.webui
    params.n_gpu_layers = options.gpu_layers
    params.use_jinja = options.jinja
    params.reasoning_format = getattr(
        xlc.common_reasoning_format, REASONING_FORMATS[options.reasoning_format]
    )
    params.api_keys = list(options.api_keys)
    return params


def version_text() -> str:
    """llama-server's `--version` lines. xllamacpp builds llama.cpp without git metadata, so the
    build number comes from its own version (`YYYY.M.<llama.cpp build>`) when it is missing."""
    info: dict[str, Any] = xlc.BUILD_INFO
    build = int(info["build_number"]) or int(str(xlc.__version__).split(".")[2])
    return (
        f"version: {build} ({info['commit']})\n"
        f"built with {info['compiler']} for {info['build_target']}\n"
    )


def serve(options: LaunchOptions) -> int:
    """Run until SIGTERM/SIGINT; 0 after a clean stop, 1 when the server cannot start.

    The stop signals are blocked before llama.cpp starts its threads, which inherit the mask, so
    a signal waits for `sigwait` here instead of landing on a C++ thread.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        server = xlc.Server(build_params(options))
    except RuntimeError as exc:  # llama.cpp has already logged the cause
        print(f"llama-server: exiting: {exc}", file=sys.stderr)
        return 1
    signal.sigwait(STOP_SIGNALS)
    # A second signal now ends the process at once, as llama-server does.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    del server  # ~Server terminates the task loop, stops HTTP and joins the threads
    return 0


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        sys.stderr.write(version_text())  # llama-server prints these to stderr
        return 0
    return serve(parse_options(parser, args, os.environ if env is None else env))


def write_wrapper(directory: Path, python: str = sys.executable) -> Path:
    """Write an executable `llama-server` into `directory` that runs this launcher."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "llama-server"
    path.write_text(
        f"#!{python}\n"
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "from llama_server import main\n"
        "raise SystemExit(main())\n"
    )
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
