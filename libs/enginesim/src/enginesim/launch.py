"""Start one simulated engine in the form it was launched with (what the install shims call)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from enginesim import llamacpp, sglang, tensorfold, vllm
from enginesim.behaviour import Behaviour, load_behaviour

Form = Literal[
    "vllm-api-server",
    "vllm-cli",
    "sglang-launch-server",
    "sglang-cli",
    "llama-server",
    "tensorfold",
]

_MAINS: dict[Form, Callable[[list[str], str, Behaviour], int]] = {
    "vllm-api-server": vllm.main,
    "vllm-cli": vllm.cli_main,
    "sglang-launch-server": sglang.main,
    "sglang-cli": sglang.cli_main,
    "llama-server": lambda argv, build, behaviour: llamacpp.main(argv, int(build), behaviour),
    "tensorfold": tensorfold.main,
}


def run(form: Form, version: str, argv: Sequence[str], behaviour_file: Path | None) -> int:
    """Run the engine `form` at `version` (a llama.cpp build number) with `argv`."""
    return _MAINS[form](list(argv), version, load_behaviour(behaviour_file))
