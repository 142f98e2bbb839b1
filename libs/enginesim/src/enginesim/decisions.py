"""System One decisions (`POST /v1/systemone`): the request's checks, the answers, and which
decision head the loaded model has, shared by the three families.

A request sends a `state` (text, or JSON rendered compactly) and questions keyed by the
caller's ids: `choice` (named options), `score` (2-10 levels, lowest first) or `noul`
(yes/no). Every option gets a probability from one prefill; no text is generated. The
simulator's probabilities are a softmax over numbers taken from the sha256 of the state's
text, the question's id and the option, so the same request always gets the same answer.
A question's `confidence` is 1 minus the normalized entropy of its probabilities: 1 when one
option holds all the mass, 0 when they are flat.

How an engine answers depends on the model it loaded (`hf_checkpoint`, `gguf_decision_type`):
SGLang reads a decision checkpoint's head (`decision_config.json`), a Clef joint-schema head
(`joint_head_config.json` and `joint_head.safetensors`), or, for a plain chat model, the
probabilities of label tokens; llama.cpp reads `<architecture>.decision.type` in the GGUF
file's metadata.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from capycommon import gguf
from enginesim.bodies import Strict
from enginesim.openai_chat import JsonDict, count_prompt_tokens

MAX_OPTIONS = 255
MAX_LEVELS = 10
# SGLang's decision-checkpoint path (`decision_config.json`).
MAX_CHECKPOINT_QUESTIONS = 16
# What a served model may also be called on /v1/systemone (TypeSafe's SDKs send these).
JEV_ALIASES = frozenset({"jev-latest", "jev-preview"})
# llama.cpp: decision types whose whole prompt is evaluated in one batch (--ubatch-size).
ONE_BATCH_TYPES = frozenset({"clef", "laya", "lfm2-d1-omni"})
# llama.cpp: decision types that cannot generate text.
DECISION_ONLY_TYPES = frozenset({"clef"})
# llama.cpp: the most choice options by decision type (MAX_OPTIONS for the others).
OPTION_LIMITS = {"openjev": 52}

Checkpoint = Literal["decision_config", "joint_head", "chat"]


class NoulCriteria(Strict):
    true: str | None = None
    false: str | None = None


class NoulQuestion(Strict):
    type: Literal["noul"]
    instructions: str | None = None
    criteria: NoulCriteria | None = None

    @model_validator(mode="after")
    def _asks_something(self) -> NoulQuestion:
        criteria = self.criteria or NoulCriteria()
        if not any((self.instructions, criteria.true, criteria.false)):
            raise ValueError("a noul question needs instructions or a true or false description")
        return self


class ChoiceQuestion(Strict):
    type: Literal["choice"]
    instructions: str | None = None
    criteria: dict[str, str | None] = Field(min_length=2)


class ScoreQuestion(Strict):
    type: Literal["score"]
    instructions: str | None = None
    criteria: list[str] = Field(min_length=2, max_length=MAX_LEVELS)


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class DecisionRequest(BaseModel):
    """A System One request; unknown top-level fields are ignored, as its schema allows.
    SGLang requires `model`; llama.cpp and vLLM answer for their own model without it."""

    model: str | None = None
    state: str | dict[str, Any] | list[Any]
    questions: dict[str, Question] = Field(min_length=1)
    images: list[Any] = Field(default_factory=list)
    files: list[Any] = Field(default_factory=list)  # llama.cpp's name for images


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a request: where (inside the body), what, and its kind."""

    loc: tuple[str | int, ...]
    msg: str
    type: str

    def text(self) -> str:
        where = ".".join(str(part) for part in self.loc) or "body"
        return f"{where}: {self.msg}"


class Invalid(Exception):
    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(problem.text() for problem in problems))
        self.problems = problems


@dataclass(frozen=True)
class Limits:
    """What one engine and model take: options per choice, questions per request."""

    max_options: int = MAX_OPTIONS
    max_questions: int | None = None


def parse(raw: bytes, limits: Limits) -> DecisionRequest:
    """The request in `raw`, or Invalid naming every problem found."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise Invalid([Problem((), f"JSON decode error: {exc}", "json_invalid")]) from exc
    try:
        body = DecisionRequest.model_validate(data)
    except ValidationError as exc:
        problems = [Problem(tuple(e["loc"]), e["msg"], e["type"]) for e in exc.errors()]
        raise Invalid(problems) from exc
    problems = list(_beyond(body, limits))
    if problems:
        raise Invalid(problems)
    return body


def _beyond(body: DecisionRequest, limits: Limits) -> Iterator[Problem]:
    most = limits.max_questions
    if most is not None and len(body.questions) > most:
        yield Problem(
            ("questions",), f"at most {most} questions, not {len(body.questions)}", "too_long"
        )
    for qid, question in body.questions.items():
        count = len(question.criteria) if isinstance(question, ChoiceQuestion) else 0
        if count > limits.max_options:
            yield Problem(
                ("questions", qid, "criteria"),
                f"at most {limits.max_options} options, not {count}",
                "too_long",
            )


# The prompt ----------------------------------------------------------------------------


def state_text(state: str | dict[str, Any] | list[Any]) -> str:
    """The state as the prompt holds it: a string as it is, anything else as compact JSON."""
    if isinstance(state, str):
        return state
    return json.dumps(state, separators=(",", ":"), ensure_ascii=False)


def prompt_text(body: DecisionRequest) -> str:
    """The state, then each question's instructions and options with their descriptions."""
    parts = [state_text(body.state)]
    for question in body.questions.values():
        parts.append(question.instructions or "")
        if isinstance(question, ChoiceQuestion):
            parts += [f"{name}: {text or ''}" for name, text in question.criteria.items()]
        elif isinstance(question, ScoreQuestion):
            parts += question.criteria
        elif question.criteria is not None:
            parts += [question.criteria.true or "", question.criteria.false or ""]
    return "\n".join(parts)


def prompt_tokens(body: DecisionRequest) -> int:
    return count_prompt_tokens(prompt_text(body))


# The answers ---------------------------------------------------------------------------


def _unit(*parts: str) -> float:
    """A number in [0, 1) taken from the sha256 of `parts`."""
    digest = hashlib.sha256("\x00".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def probabilities(state: str, qid: str, options: Sequence[str]) -> list[float]:
    """A softmax over one number in [0, 4) per option."""
    logits = [4.0 * _unit(state, qid, option) for option in options]
    top = max(logits)
    weights = [math.exp(logit - top) for logit in logits]
    total = math.fsum(weights)
    return [weight / total for weight in weights]


def confidence(probs: Sequence[float]) -> float:
    """1 minus the entropy over its most (log n): 1 for a sure answer, 0 for a flat one."""
    entropy = -math.fsum(p * math.log(p) for p in probs if p > 0)
    return max(0.0, 1.0 - entropy / math.log(len(probs)))


def answer(state: str, qid: str, question: Question) -> JsonDict:
    if isinstance(question, ChoiceQuestion):
        names = list(question.criteria)
        probs = probabilities(state, qid, names)
        best = max(range(len(names)), key=probs.__getitem__)
        return {
            "type": "choice",
            "choice": names[best],
            "probabilities": dict(zip(names, probs, strict=True)),
            "confidence": confidence(probs),
        }
    if isinstance(question, ScoreQuestion):
        keys = [str(index) for index in range(len(question.criteria))]
        probs = probabilities(
            state, qid, [f"{k}:{t}" for k, t in zip(keys, question.criteria, strict=True)]
        )
        return {
            "type": "score",
            "score": math.fsum(index * p for index, p in enumerate(probs)),
            "legend": dict(zip(keys, question.criteria, strict=True)),
            "probabilities": dict(zip(keys, probs, strict=True)),
            "confidence": confidence(probs),
        }
    probs = probabilities(state, qid, ["true", "false"])
    return {"type": "noul", "noul": probs[0], "confidence": confidence(probs)}


def label_mass(state: str, qid: str) -> float:
    """Read from the text output: the share of the next token's probability that its labels
    hold (the rest went to other tokens), in [0.9, 1)."""
    return 0.9 + 0.1 * _unit(state, qid, "label mass")


def response(body: DecisionRequest, model: str, input_tokens: int) -> JsonDict:
    """The answer every family gives, naming `model`; a family adds its own fields."""
    state = state_text(body.state)
    answers = {qid: answer(state, qid, question) for qid, question in body.questions.items()}
    return {
        "model": model,
        "answers": answers,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }


# The model's decision head ---------------------------------------------------------------


def hf_checkpoint(model: Path) -> Checkpoint:
    """Which head a Hugging Face model folder has, as SGLang finds it; "chat" for none."""
    if (model / "decision_config.json").is_file():
        return "decision_config"
    joint = ("joint_head_config.json", "joint_head.safetensors")
    if all((model / name).is_file() for name in joint):
        return "joint_head"
    return "chat"


def gguf_decision_type(model: Path) -> str | None:
    """The decision type a GGUF file declares; None for none, or for a file that is not GGUF."""
    try:
        return gguf.decision_type(model)
    except (gguf.NotGguf, OSError):
        return None


def architecture(decision_type: str | None) -> JsonDict:
    """llama.cpp's `architecture` in /v1/models for a model of this decision type (build
    11549: `["decisions"]` for every decision type, chat or not)."""
    outputs = ["text"] if decision_type is None else ["decisions"]
    return {"input_modalities": ["text"], "output_modalities": outputs}
