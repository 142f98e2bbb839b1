"""Decision requests: OpenAI's Decisions shape (`POST /v1/decisions`), checked here, and its
translation to System One (`POST /v1/systemone`, what SGLang and llama.cpp answer) and back.

A decision model answers typed questions about a state with a probability for every option,
from one prefill, and generates no text. The two shapes ask the same things:

- `predicate` is `noul`, with no criteria;
- `choice` with `choices[{value, description?}]` is `choice` with `criteria{value:
  description or null}`; a boolean value is the string `true` or `false`;
- `score` with ascending `levels[{label, description?}]` is `score` with `criteria[label, or
  "label: description"]`, lowest first.

Every question gets the id `q<index>` on the way to the engine, named or not: a caller's name
never has to be a valid id, and never clashes with another's. Answers come back in the
request's order, under the caller's names (null where it gave none), choice probabilities in
the caller's order of options, and booleans as booleans again.

Images are not taken in this release (`unsupported_parameter`), nor any field this module does
not know (`invalid_request`): nothing a caller sends is silently dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from capyctl_router.bodies import MAX_SALT

JsonDict = dict[str, Any]

# Each engine's limits; a request beyond them is refused before it is queued.
MAX_OPTIONS = 255
MAX_LEVELS = 10
MIN_OPTIONS = 2
MIN_LEVELS = 2


@dataclass(frozen=True)
class Limits:
    """How many questions (None: no bound of its own), and options per choice, one engine
    takes in one request."""

    questions: int | None
    options: int = MAX_OPTIONS


# SGLang's decision checkpoints take 16 questions; llama.cpp sets no bound of its own.
LIMITS = {"sglang": Limits(questions=16), "llamacpp": Limits(questions=None)}
# The most questions a request may ask, whatever the engine.
MAX_QUESTIONS = 400


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class ChoiceOption(_Strict):
    value: StrictStr | StrictBool
    description: str | None = None

    @property
    def key(self) -> str:
        """The option's System One name: a boolean as `true` or `false`."""
        if isinstance(self.value, bool):
            return "true" if self.value else "false"
        return self.value


class ScoreLevel(_Strict):
    label: Annotated[str, Field(min_length=1)]
    description: str | None = None


class Question(_Strict):
    type: Literal["predicate", "choice", "score"]
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    instructions: Annotated[str, Field(min_length=1)] | list[InputText]
    choices: list[ChoiceOption] | None = None
    levels: list[ScoreLevel] | None = None

    @model_validator(mode="after")
    def _criteria(self) -> Question:
        if self.type == "choice":
            _between(self.choices, MIN_OPTIONS, MAX_OPTIONS, "choices", "a choice")
            keys = [option.key for option in self.choices or []]
            repeated = sorted({key for key in keys if keys.count(key) > 1})
            if repeated:
                raise ValueError(f"choice values {', '.join(repeated)} are given twice")
        elif self.choices is not None:
            raise ValueError(f"choices belong to choice questions, not {self.type}")
        if self.type == "score":
            _between(self.levels, MIN_LEVELS, MAX_LEVELS, "levels", "a score")
        elif self.levels is not None:
            raise ValueError(f"levels belong to score questions, not {self.type}")
        return self

    @property
    def text(self) -> str:
        """The instructions as one text, parts in order."""
        if isinstance(self.instructions, str):
            return self.instructions
        return "\n\n".join(part.text for part in self.instructions)


def _between(items: list[Any] | None, low: int, high: int, field: str, what: str) -> None:
    if items is None or not low <= len(items) <= high:
        count = 0 if items is None else len(items)
        raise ValueError(f"{what} question needs {low} to {high} {field}, not {count}")


class InputImage(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["input_image"]


class Message(_Strict):
    role: Literal["user"]
    content: str | list[InputText | InputImage]
    type: Literal["message"] | None = None


class DecisionsRequest(_Strict):
    """`POST /v1/decisions`, as OpenAI's Decisions API takes it."""

    model: Annotated[str, Field(min_length=1)]
    input: str | list[Message]
    questions: Annotated[list[Question], Field(min_length=1, max_length=MAX_QUESTIONS)]
    # Accepted, and not passed on: it identifies the caller to OpenAI's own safety systems.
    safety_identifier: str | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_SALT)] | None = None

    @model_validator(mode="after")
    def _unique_names(self) -> DecisionsRequest:
        names = [q.name for q in self.questions if q.name is not None]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"question names {', '.join(repeated)} are given twice")
        return self

    def option_counts(self) -> list[int]:
        """How many options each question offers (0 for one that is no choice)."""
        return [len(question.choices or []) for question in self.questions]

    @property
    def images(self) -> bool:
        return isinstance(self.input, list) and any(
            isinstance(part, InputImage)
            for message in self.input
            if isinstance(message.content, list)
            for part in message.content
        )

    def state(self) -> str:
        """The state the questions are about: the input's text, messages' parts in order."""
        if isinstance(self.input, str):
            return self.input
        texts = []
        for message in self.input:
            if isinstance(message.content, str):
                texts.append(message.content)
            else:
                texts += [part.text for part in message.content if isinstance(part, InputText)]
        return "\n\n".join(texts)


def over_limits(request: DecisionsRequest | SystemOneRequest, family: str) -> str | None:
    """Why the engine family would refuse the request's size (either shape), or None."""
    limits = LIMITS.get(family)
    if limits is None:
        return None
    questions = len(request.questions)
    if limits.questions is not None and questions > limits.questions:
        return f"{questions} questions; {family} takes at most {limits.questions}"
    for index, count in enumerate(request.option_counts()):
        if count > limits.options:
            return (
                f"questions[{index}] has {count} options; {family} takes at most {limits.options}"
            )
    return None


def qid(index: int) -> str:
    return f"q{index}"


def to_system_one(request: DecisionsRequest, served_name: str) -> JsonDict:
    """The System One body an engine gets for an OpenAI decisions request."""
    questions: JsonDict = {}
    for index, question in enumerate(request.questions):
        asked: JsonDict = {
            "type": "noul" if question.type == "predicate" else question.type,
            "instructions": question.text,
        }
        if question.type == "choice":
            asked["criteria"] = {o.key: o.description for o in question.choices or []}
        elif question.type == "score":
            asked["criteria"] = [
                level.label if not level.description else f"{level.label}: {level.description}"
                for level in question.levels or []
            ]
        questions[qid(index)] = asked
    return {"model": served_name, "state": request.state(), "questions": questions}


# System One ----------------------------------------------------------------------------------


class SystemOneQuestion(BaseModel):
    """One System One question; fields beyond these pass to the engine as sent."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    type: Literal["choice", "score", "noul"]
    instructions: Annotated[str, Field(min_length=1)]
    criteria: dict[str, str | None] | list[str] | None = None

    @model_validator(mode="after")
    def _criteria(self) -> SystemOneQuestion:
        criteria = self.criteria
        if self.type == "choice":
            if not isinstance(criteria, dict):
                raise ValueError("a choice question's criteria is an object: option -> text")
            _between(list(criteria), MIN_OPTIONS, MAX_OPTIONS, "options", "a choice")
        elif self.type == "score":
            if not isinstance(criteria, list):
                raise ValueError("a score question's criteria is an array of levels, lowest first")
            _between(criteria, MIN_LEVELS, MAX_LEVELS, "levels", "a score")
        elif criteria is not None and (
            not isinstance(criteria, dict) or not set(criteria) <= {"true", "false"}
        ):
            raise ValueError("a noul question's criteria, if any, is {true: ..., false: ...}")
        return self


class SystemOneRequest(BaseModel):
    """`POST /v1/systemone`, as TypeSafe's System One takes it: checked here, then passed to
    the engine as sent but for its model (the engine's served name)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: Annotated[str, Field(min_length=1)]
    state: str | dict[str, Any] | list[Any]
    questions: Annotated[
        dict[str, SystemOneQuestion], Field(min_length=1, max_length=MAX_QUESTIONS)
    ]

    def option_counts(self) -> list[int]:
        """How many options each question offers (0 for one that is no choice)."""
        return [
            len(q.criteria) if q.type == "choice" and q.criteria else 0
            for q in self.questions.values()
        ]


class MalformedAnswer(ValueError):
    """The engine's System One answer lacks what the request asked for."""


def from_system_one(request: DecisionsRequest, answer: JsonDict, model: str) -> JsonDict:
    """The OpenAI decisions response for the engine's System One answer, under `model` (the
    id the client asked for). MalformedAnswer if an answer is missing or not of its type."""
    found = answer.get("answers")
    if not isinstance(found, dict):
        raise MalformedAnswer("the engine's answer has no answers object")
    answers = [
        _answer(question, found.get(qid(index)), index)
        for index, question in enumerate(request.questions)
    ]
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    read = usage.get("input_tokens", usage.get("prompt_tokens", 0))
    input_tokens = read if isinstance(read, int) and not isinstance(read, bool) else 0
    return {
        "model": model,
        "answers": answers,
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens,
        },
    }


def _answer(question: Question, given: object, index: int) -> JsonDict:
    where = f"answers.{qid(index)}"
    if not isinstance(given, dict):
        raise MalformedAnswer(f"the engine gave no {where}")
    base: JsonDict = {"type": question.type, "name": question.name}
    if question.type == "predicate":
        return {**base, "probability": _number(given, "noul", where)}
    probabilities = given.get("probabilities")
    if not isinstance(probabilities, dict):
        raise MalformedAnswer(f"{where} has no probabilities")
    confidence = given.get("confidence")
    if isinstance(confidence, bool) or not isinstance(confidence, int | float):
        confidence = _confidence([_number(probabilities, key, where) for key in probabilities])
    if question.type == "choice":
        options = question.choices or []
        by_key = {o.key: o.value for o in options}
        chosen = given.get("choice")
        if chosen not in by_key:
            raise MalformedAnswer(f"{where}.choice {chosen!r} is none of the options")
        return {
            **base,
            "choice": by_key[chosen],
            "probabilities": [
                {"value": o.value, "probability": _number(probabilities, o.key, where)}
                for o in options
            ],
            "confidence": confidence,
        }
    levels = question.levels or []
    return {
        **base,
        "score": _number(given, "score", where),
        "probabilities": [
            {
                "value": level,
                "label": levels[level].label,
                "probability": _number(probabilities, str(level), where),
            }
            for level in range(len(levels))
        ],
        "confidence": confidence,
    }


def _confidence(probabilities: list[float]) -> float:
    """1 when one option holds all the mass, 0 when it is spread evenly: one less the
    distribution's entropy over its largest."""
    if len(probabilities) < 2:
        return 1.0
    entropy = -sum(p * math.log(p) for p in probabilities if p > 0)
    return max(0.0, min(1.0, 1.0 - entropy / math.log(len(probabilities))))


def _number(found: JsonDict, key: str, where: str) -> float:
    value = found.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedAnswer(f"{where}: {key} is {value!r}, not a number")
    return float(value)
