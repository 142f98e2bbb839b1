"""Decision models on disk for tests: Hugging Face folders with or without a decision head,
and tiny real GGUF files whose metadata names (or not) a decision type."""

from __future__ import annotations

import json
import string
import struct
from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np

Head = Literal["decision_config", "joint_head", "none"]


def asked(kind: str, instructions: str, criteria: Any = None) -> dict[str, Any]:
    """A question as System One is asked it: of type `kind` (noul, choice or score), with its
    `criteria` (a choice's options, a score's levels, a noul's meaning of true and false) if
    given."""
    question: dict[str, Any] = {"type": kind, "instructions": instructions}
    if criteria is not None:
        question["criteria"] = criteria
    return question


# A System One request but for its model: every question type, a JSON state.
SYSTEM_ONE: dict[str, Any] = {
    "state": {"ticket": 4411, "text": "the app crashes"},
    "questions": {
        "bug": asked("noul", "Is it a bug report?"),
        "team": asked("choice", "Which team owns it?", {"mobile": "the apps", "web": None}),
        "urgency": asked("score", "How urgent is it?", ["low", "medium", "high"]),
    },
}
# The questions of a `/v1/decisions` request: every question type, each named.
DECISIONS: list[Any] = [
    {"type": "predicate", "name": "bug", "instructions": "Is it a bug report?"},
    {
        "type": "choice",
        "name": "team",
        "instructions": "Which team owns it?",
        "choices": [{"value": "mobile", "description": "the apps"}, {"value": "web"}],
    },
    {
        "type": "score",
        "name": "urgency",
        "instructions": "How urgent is it?",
        "levels": [{"label": "low"}, {"label": "medium"}, {"label": "high"}],
    },
    {
        "type": "choice",
        "name": "reply",
        "instructions": "Should we reply today?",
        "choices": [{"value": True}, {"value": False}],
    },
]


def unnamed(questions: list[Any], name: str) -> list[Any]:
    """`questions` with question `name` left unnamed (its answer is then known by its place)."""
    return [
        {key: value for key, value in question.items() if key != "name"}
        if question["name"] == name
        else question
        for question in questions
    ]


# (architecture, model_type) of each folder's config.json; Clef's backbone is Qwen3.5.
ARCHITECTURES: dict[Head, tuple[str, str]] = {
    "decision_config": ("Qwen3ForCausalLM", "qwen3"),
    "joint_head": ("Qwen3_5ForConditionalGeneration", "qwen3_5"),
    "none": ("Qwen3ForCausalLM", "qwen3"),
}


def safetensors(path: Path, name: str, values: list[float]) -> Path:
    """A valid safetensors file holding one float32 vector."""
    header = {name: {"dtype": "F32", "shape": [len(values)], "data_offsets": [0, 4 * len(values)]}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data = struct.pack(f"<{len(values)}f", *values)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def decision_folder(path: Path, head: Head = "decision_config") -> Path:
    """A model folder at `path`: config.json and tiny weights, plus `decision_config.json`
    (a decision checkpoint), or `joint_head_config.json` and `joint_head.safetensors` (a
    Clef joint-schema head), or neither ("none": a plain chat model)."""
    path.mkdir(parents=True, exist_ok=True)
    architecture, model_type = ARCHITECTURES[head]
    config = {"architectures": [architecture], "model_type": model_type, "hidden_size": 8}
    (path / "config.json").write_text(json.dumps(config))
    safetensors(path / "model.safetensors", "lm_head.weight", [0.0] * 8)
    if head == "decision_config":
        codes = list(string.ascii_uppercase)
        decision = {"codes": codes, "token_ids": [32 + i for i in range(26)], "temperature": 1.25}
        (path / "decision_config.json").write_text(json.dumps(decision))
    elif head == "joint_head":
        joint = {"hidden_size": 8, "num_layers": 2, "num_heads": 2, "max_options": 255}
        (path / "joint_head_config.json").write_text(json.dumps(joint))
        safetensors(path / "joint_head.safetensors", "joint_head.score.weight", [0.5] * 8)
    return path


def decision_gguf(path: Path, decision: str | None = "kev", architecture: str = "qwen3") -> Path:
    """A tiny real GGUF file; its metadata says `<architecture>.decision.type = decision`
    unless `decision` is None."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), architecture)
    if decision is not None:
        writer.add_string(f"{architecture}.decision.type", decision)
    writer.add_tensor("token_embd.weight", np.zeros(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
