"""OpenAI's Decisions shape, checked, and translated to System One and back (golden bodies):
every question type, booleans as choice values, unnamed questions, the request's order, and
the refusals."""

from __future__ import annotations

from math import log
from typing import Any

import pytest
from pydantic import ValidationError

from capyctl_router.decisions import (
    DecisionsRequest,
    MalformedAnswer,
    from_system_one,
    over_limits,
    to_system_one,
)
from decisionmodels import asked

REQUEST: dict[str, Any] = {
    "model": "judge",
    "input": [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Ticket: the app crashes"}],
        },
        {"role": "user", "content": "on every start."},
    ],
    "questions": [
        {"type": "predicate", "name": "bug", "instructions": "Is it a bug report?"},
        {
            "type": "choice",
            "instructions": "Which team?",
            "choices": [
                {"value": "mobile", "description": "the apps"},
                {"value": "web"},
            ],
        },
        {
            "type": "score",
            "name": "urgency",
            "instructions": "How urgent?",
            "levels": [
                {"label": "low"},
                {"label": "high", "description": "users are blocked"},
            ],
        },
        {
            "type": "choice",
            "name": "reply",
            "instructions": "Should we reply today?",
            "choices": [{"value": True}, {"value": False}],
        },
    ],
}

SYSTEM_ONE = {
    "model": "served",
    "state": "Ticket: the app crashes\n\non every start.",
    "questions": {
        "q0": asked("noul", "Is it a bug report?"),
        "q1": asked("choice", "Which team?", {"mobile": "the apps", "web": None}),
        "q2": asked("score", "How urgent?", ["low", "high: users are blocked"]),
        "q3": asked("choice", "Should we reply today?", {"true": None, "false": None}),
    },
}

ANSWER: dict[str, Any] = {
    "model": "served",
    "answers": {
        "q3": {"type": "choice", "choice": "false", "probabilities": {"true": 0.3, "false": 0.7}},
        "q0": {"type": "noul", "noul": 0.91},
        "q2": {
            "type": "score",
            "score": 0.8,
            "legend": {"0": "low", "1": "high: users are blocked"},
            "probabilities": {"0": 0.2, "1": 0.8},
            "confidence": 0.4,
        },
        "q1": {
            "type": "choice",
            "choice": "mobile",
            "probabilities": {"web": 0.25, "mobile": 0.75},
            "confidence": 0.5,
        },
    },
    "usage": {"input_tokens": 42, "output_tokens": 4},
}


def parsed(**changes: Any) -> DecisionsRequest:
    return DecisionsRequest.model_validate({**REQUEST, **changes})


def test_openai_questions_become_system_one_questions_with_ids_in_order() -> None:
    assert to_system_one(parsed(), "served") == SYSTEM_ONE


def test_system_one_answers_come_back_in_order_under_the_callers_names_and_values() -> None:
    assert from_system_one(parsed(), ANSWER, "judge") == {
        "model": "judge",
        "answers": [
            {"type": "predicate", "name": "bug", "probability": 0.91},
            {
                "type": "choice",
                "name": None,
                "choice": "mobile",
                "probabilities": [
                    {"value": "mobile", "probability": 0.75},
                    {"value": "web", "probability": 0.25},
                ],
                "confidence": 0.5,
            },
            {
                "type": "score",
                "name": "urgency",
                "score": 0.8,
                "probabilities": [
                    {"value": 0, "label": "low", "probability": 0.2},
                    {"value": 1, "label": "high", "probability": 0.8},
                ],
                "confidence": 0.4,
            },
            {
                "type": "choice",
                "name": "reply",
                "choice": False,
                "probabilities": [
                    {"value": True, "probability": 0.3},
                    {"value": False, "probability": 0.7},
                ],
                # The engine gave none: one less the entropy over its largest (ln 2).
                "confidence": pytest.approx(1 - (-0.3 * log(0.3) - 0.7 * log(0.7)) / log(2)),
            },
        ],
        "usage": {
            "input_tokens": 42,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 42,
        },
    }


def test_a_plain_string_input_is_the_state() -> None:
    assert to_system_one(parsed(input="just text"), "s")["state"] == "just text"


@pytest.mark.parametrize(
    ("questions", "said"),
    [
        ([], "at least 1 item"),
        (
            [
                {"type": "predicate", "name": "a", "instructions": "x"},
                {"type": "predicate", "name": "a", "instructions": "y"},
            ],
            "question names a are given twice",
        ),
        (
            [{"type": "choice", "instructions": "x", "choices": [{"value": "only"}]}],
            "a choice question needs 2 to 255 choices, not 1",
        ),
        (
            [
                {
                    "type": "choice",
                    "instructions": "x",
                    "choices": [{"value": "true"}, {"value": True}],
                }
            ],
            "choice values true are given twice",
        ),
        (
            [{"type": "score", "instructions": "x", "levels": [{"label": "l"}] * 11}],
            "a score question needs 2 to 10 levels, not 11",
        ),
        (
            [
                {
                    "type": "predicate",
                    "instructions": "x",
                    "levels": [{"label": "a"}, {"label": "b"}],
                }
            ],
            "levels belong to score questions, not predicate",
        ),
        ([{"type": "rank", "instructions": "x"}], "type"),
    ],
)
def test_a_bad_request_is_refused_naming_the_problem(questions: list[Any], said: str) -> None:
    with pytest.raises(ValidationError, match=said):
        parsed(questions=questions)


def test_an_unknown_field_is_refused_not_dropped() -> None:
    with pytest.raises(ValidationError, match="temperature"):
        parsed(temperature=0.5)


def test_images_are_noticed() -> None:
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "data:,x"}]}
    assert parsed(input=[image]).images
    assert not parsed().images


def test_each_engines_limits() -> None:
    many = [{"type": "predicate", "instructions": f"q{i}"} for i in range(17)]
    assert over_limits(parsed(questions=many), "sglang") == "17 questions; sglang takes at most 16"
    assert over_limits(parsed(questions=many), "llamacpp") is None
    assert over_limits(parsed(), "sglang") is None


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        ({"answers": []}, "no answers object"),
        ({"answers": {"q0": {"noul": 0.5}}}, "no answers.q1"),
        (
            {
                **ANSWER,
                "answers": {**ANSWER["answers"], "q1": {"choice": "ios", "probabilities": {}}},
            },
            "'ios' is none of the options",
        ),
        (
            {**ANSWER, "answers": {**ANSWER["answers"], "q0": {"noul": "high"}}},
            "noul is 'high', not a number",
        ),
    ],
)
def test_an_engine_answer_that_lacks_an_answer_is_malformed(
    answer: dict[str, Any], said: str
) -> None:
    with pytest.raises(MalformedAnswer, match=said):
        from_system_one(parsed(), answer, "judge")
