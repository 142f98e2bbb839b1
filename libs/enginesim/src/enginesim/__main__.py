"""Run a simulated engine, or install one.

python -m enginesim --family vllm --version 0.17.0 -- --model M ...
python -m enginesim --family vllm --version 0.17.0 -- serve M ...
python -m enginesim --family sglang --version 0.5.10 -- --model-path M
python -m enginesim --family llamacpp --version 6500 -- -m model.gguf
python -m enginesim --family tensorfold --version 0.6.6 -- serve --model M --context-length N
python -m enginesim install vllm|sglang VENV --version V [--behaviour F]
python -m enginesim install llamacpp FOLDER --version BUILD
python -m enginesim install tensorfold FOLDER --version V
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from enginesim.behaviour import load_behaviour
from enginesim.install import install_llama_server, install_python_engine, install_tensorfold
from enginesim.launch import Form, run

FAMILIES = ("vllm", "sglang", "llamacpp", "tensorfold")


def _install(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m enginesim install")
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument(
        "target", type=Path, help="the venv to create, or the llama-server or tensorfold folder"
    )
    parser.add_argument("--version", required=True, help="the version, or the llama.cpp build")
    parser.add_argument("--behaviour", type=Path, help="a behaviour JSON document")
    args = parser.parse_args(argv)
    behaviour = load_behaviour(args.behaviour) if args.behaviour else None
    if args.family == "llamacpp":
        print(install_llama_server(args.target, int(args.version), behaviour))
    elif args.family == "tensorfold":
        print(install_tensorfold(args.target, args.version, behaviour))
    else:
        print(install_python_engine(args.target, args.family, args.version, behaviour))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["install"]:
        return _install(given[1:])
    ours, engine = (
        (given[: given.index("--")], given[given.index("--") + 1 :])
        if ("--" in given)
        else (given, [])
    )
    parser = argparse.ArgumentParser(prog="python -m enginesim")
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--behaviour", type=Path)
    args = parser.parse_args(ours)
    form: Form = "llama-server"
    if args.family == "vllm":
        form = "vllm-cli" if engine[:1] == ["serve"] else "vllm-api-server"
    elif args.family == "sglang":
        form = "sglang-cli" if engine[:1] == ["serve"] else "sglang-launch-server"
    elif args.family == "tensorfold":
        form = "tensorfold"
    return run(form, args.version, engine, args.behaviour)


if __name__ == "__main__":
    raise SystemExit(main())
