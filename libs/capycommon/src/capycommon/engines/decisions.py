"""Decision models on the engines (`api: decisions`, docs/decisions.md): what a launch bars,
the canary that proves the engine decides, and llama.cpp's own word that it does.

A decision model answers typed questions about a state with a probability for every option,
from one prefill, and generates no text. SGLang (0.5.22 on) and llama.cpp answer it over
System One (`POST /v1/systemone`) from the model's decision head. The readout needs the
checkpoint's own chat template, prefill-only requests and the whole prompt, so SGLang runs
it without a template override, speculative decoding or auto-truncation, and with its radix
cache off (as the 0.1.7 notes run it); llama.cpp evaluates some heads' prompts (clef, laya,
lfm2-d1-omni) in one micro-batch, so its batch and micro-batch are a slot's context (llama.cpp
splits the context among its slots: no prompt is longer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from capycommon.engines.families import Family
from capycommon.errors import InvalidConfig

SYSTEMONE_PATH = "/v1/systemone"
# What llama.cpp's /v1/models says a decision model outputs.
DECISIONS_MODALITY = "decisions"

# Flags a decision model's launch bars, by family, and why.
BARRED: Mapping[Family, Mapping[str, str]] = {
    Family.SGLANG: {
        "--chat-template": "the decision head reads the checkpoint's own chat template",
        "--speculative-algorithm": "the readout needs prefill-only requests",
        "--allow-auto-truncate": "a cut prompt loses the readout positions",
        "--enable-mis": "SGLang refuses decision requests with it",
        "--dllm-algorithm": "SGLang refuses decision requests with it",
        "--disable-radix-cache": "CapyCTL sets it for a decision model",
        "--enable-lmcache": "SGLang fails with LMCache while its radix cache is off",
    },
    Family.LLAMACPP: {
        "--batch-size": "CapyCTL sets it to a slot's context for a decision model",
        "--ubatch-size": "CapyCTL sets it to a slot's context for a decision model",
    },
}


# llama.cpp gives each slot at least this many tokens of context, raising the whole.
LLAMACPP_MIN_SLOT = 256


def check_args(family: Family, extra_args: Iterable[str]) -> None:
    """Refuse an extra argument a decision model's launch bars, naming it and why."""
    barred = BARRED.get(family, {})
    for arg in extra_args:
        name = arg.split("=", 1)[0]
        if not name.startswith("--") or len(name) <= 2:
            continue
        flag = next((flag for flag in barred if flag.startswith(name)), None)
        if flag is not None:
            shown = name if name == flag else f"{name} (that is {flag})"
            raise InvalidConfig(
                f"engine_config.extra_args: {shown} is barred for a decision model (api: "
                f"decisions): {barred[flag]}; remove it"
            )


def launch_args(family: Family, context_length: int | None, slots: int = 1) -> list[str]:
    """What a decision model's launch adds to the family's own arguments."""
    if family == Family.SGLANG:
        return ["--disable-radix-cache"]
    if family == Family.LLAMACPP and context_length is not None:
        share = -(-context_length // slots)
        per_slot = str(min(context_length, max(share, LLAMACPP_MIN_SLOT)))
        return ["-b", per_slot, "-ub", per_slot]
    return []


# The canary: one choice between two options. Its answer is the option chosen, which a
# woken engine must choose again.
CANARY_STATE = "The sky is blue."
CANARY_OPTIONS = ("yes", "no")


def canary_body(served_name: str) -> dict[str, Any]:
    return {
        "model": served_name,
        "state": CANARY_STATE,
        "questions": {
            "canary": {
                "type": "choice",
                "instructions": "Is the statement true?",
                "criteria": dict.fromkeys(CANARY_OPTIONS),
            }
        },
    }


def canary_answer(body: object) -> str:
    """The option a canary's System One answer chose; ValueError if it chose none."""
    answers = body.get("answers") if isinstance(body, dict) else None
    answer = answers.get("canary") if isinstance(answers, dict) else None
    chosen = answer.get("choice") if isinstance(answer, dict) else None
    if chosen not in CANARY_OPTIONS:
        raise ValueError(f"the engine's decision canary chose {chosen!r}, not yes or no")
    return str(chosen)


def modalities(models: object, served_name: str) -> list[str] | None:
    """The output modalities llama.cpp's /v1/models gives the served model; None if it
    gives none."""
    data = models.get("data") if isinstance(models, dict) else None
    for entry in data if isinstance(data, list) else []:
        if not isinstance(entry, dict):
            continue
        aliases = entry.get("aliases")
        names = {entry.get("id"), *(aliases if isinstance(aliases, list) else [])}
        if served_name not in names:
            continue
        architecture = entry.get("architecture")
        found = architecture.get("output_modalities") if isinstance(architecture, dict) else None
        if isinstance(found, list):
            return [str(item) for item in found]
    return None
