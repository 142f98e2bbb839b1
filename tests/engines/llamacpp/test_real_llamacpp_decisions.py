"""llama.cpp's decision serving (`POST /v1/systemone`) on a real llama-server (xllamacpp's build).

The models are the tiny random model of `tinygguf`, once as it is (a chat model) and once marked
as a decision model through GGUF metadata alone. This build reads two things:

- `<general.architecture>.decision.type`, a string naming the type (`llama.decision.type` here);
  a name it does not know, or a value of another GGUF type, fails the load;
- a Jinja template named `systemone` (`tokenizer.chat_template.systemone`), without which a
  decision model fails to load too.

Optional `<arch>.decision.temperature.<question type>[.<bucket>]` keys divide the logits. Every
type loads on the tiny llama-architecture model once the vocabulary holds the tokens it looks up;
kev, laya, clef and lfm2-d1-omni switch the server to embedding mode.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import gguf
import httpx
import pytest

from decisionmodels import asked
from engines.llamacpp import tinygguf
from engines.llamacpp.llama_server import write_wrapper
from engines.llamacpp.test_real_llamacpp import (
    ALIAS,
    API_KEY,
    START_TIMEOUT,
    Install,
    LlamaServer,
    launch,
    running,
)
from engines.llamacpp.tinygguf import write_tiny_model
from ports import free_port
from support import clean_env, wait_for

TYPE_KEY = f"{tinygguf.ARCH}.decision.type"
TEMPERATURE_KEY = f"{tinygguf.ARCH}.decision.temperature"
# laya's token budget for the question and its options; laya fails to load without it.
HEAD_TOKENS_KEY = f"{tinygguf.ARCH}.decision.max_head_tokens"
DECISION_TYPES = (
    "openjev",
    "lev",
    "kev",
    "nimble",
    "laya",
    "clef",
    "pplx-decider",
    "lfm2-d1",
    "lfm2-d1-omni",
)
# The types that read the embeddings output rather than the logits.
EMBEDDING_TYPES = frozenset({"kev", "laya", "clef", "lfm2-d1-omni"})
# Tokens some types look up: kev reads each option at `<|box_end|>`; laya and lfm2-d1-omni need
# the vocabulary's mask token (and laya its separator).
BOX_END, SEP, MASK = "<|box_end|>", "<sep>", "<mask>"
# openjev labels the options A, B, ... and reads the logit of each label after the prompt.
OPENJEV_TEMPLATE = (
    "<|im_start|>user\n{{ state if state is string else state | tojson }}\n{{ instructions }}\n"
    "{% for option in options %}"
    "{{ 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz'[loop.index0] }}: {{ option.key }}"
    "{% if option.description %} ({{ option.description }}){% endif %}\n"
    "{% endfor %}<|im_end|>\n<|im_start|>assistant\n"
)
# laya's layout: [cls] question [sep] ([mask] option)* [sep] state [sep]; one prompt a question.
LAYA_TEMPLATE = (
    "<s>{{ instructions }}<sep>{% for option in options %}<mask>{{ option.key }}{% endfor %}"
    "<sep>{{ state }}<sep>"
)
TEXT_ARCHITECTURE = {"input_modalities": ["text"], "output_modalities": ["text"]}
DECISION_ARCHITECTURE = {"input_modalities": ["text"], "output_modalities": ["decisions"]}
NOT_A_DECISION_MODEL = {
    "error": {
        "code": 501,
        "message": "This model is not a decision model",
        "type": "not_supported_error",
    }
}
ANIMALS = {"capybara": "a large rodent", "llama": None, "bear": "big"}
QUESTIONS: dict[str, Any] = {
    "animal": asked("choice", "Which animal is it?", ANIMALS),
    "quality": asked("score", "How good is it?", ["bad", "fine", "good"]),
    "rodent": asked("noul", "Is it a rodent?"),
    "calm": asked("noul", "Is it calm?", {"true": "it rests", "false": "it runs"}),
}
STATE = {"message": "A capybara sits by the river.", "tags": ["animal", "water"]}

MetaValue = str | float | int


def write_decision_model(
    path: Path, metadata: Mapping[str, MetaValue], template: str | None = OPENJEV_TEMPLATE
) -> Path:
    """The tiny model with the marker tokens added to its vocabulary, `metadata`, and a
    `systemone` template unless `template` is None. Same arguments, same weights."""
    base = tinygguf.build_vocab()
    extra = (BOX_END, SEP, MASK)
    vocab = tinygguf.Vocab(
        [*base.tokens, *extra],
        [*base.scores, *(0.0 for _ in extra)],
        [*base.types, *(gguf.TokenType.CONTROL for _ in extra)],
    )
    writer = gguf.GGUFWriter(path, tinygguf.ARCH)
    tinygguf._write_metadata(writer, vocab)
    writer.add_sep_token_id(vocab.tokens.index(SEP))
    writer.add_mask_token_id(vocab.tokens.index(MASK))
    if template is not None:
        writer.add_string("tokenizer.chat_template.systemone", template)
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    tinygguf._write_tensors(writer, len(vocab.tokens), seed=0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def systemone(
    server: LlamaServer, body: Mapping[str, Any] | bytes, api_key: str = API_KEY
) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.base_url}/v1/systemone",
        content=content,
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
        timeout=60,
    )


def architecture(server: LlamaServer) -> Any:
    response = httpx.get(
        f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5
    )
    assert response.status_code == 200, response.text
    return response.json()["data"][0]["architecture"]


def flatten(value: Any, path: str = "") -> dict[str, Any]:
    """The leaves of a JSON value by their dotted path, for `pytest.approx`."""
    if not isinstance(value, dict):
        return {path: value}
    return {k: v for key, item in value.items() for k, v in flatten(item, f"{path}.{key}").items()}


def error(code: int, message: str, kind: str) -> dict[str, Any]:
    """llama.cpp's error body."""
    return {"error": {"code": code, "message": message, "type": kind}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llamacpp-decisions")
    write_wrapper(path)
    return path


def install_for(folder: Path, model: Path) -> Install:
    return Install(folder / "llama-server", model)


@pytest.fixture(scope="module")
def text_server(folder: Path) -> Iterator[LlamaServer]:
    with running(install_for(folder, write_tiny_model(folder / "tiny.gguf"))) as server:
        yield server


@pytest.fixture(scope="module")
def decision_server(folder: Path) -> Iterator[LlamaServer]:
    model = write_decision_model(folder / "openjev.gguf", {TYPE_KEY: "openjev"})
    with running(install_for(folder, model)) as server:
        yield server


# -- a chat model ------------------------------------------------------------------------------


def test_models_reports_text_output_for_a_chat_model(text_server: LlamaServer) -> None:
    assert architecture(text_server) == TEXT_ARCHITECTURE


@pytest.mark.parametrize(
    "body",
    [
        {"model": ALIAS, "state": "hi", "questions": {"q": QUESTIONS["rodent"]}},
        b"{not json",
        b"{}",
    ],
    ids=["valid", "malformed", "empty"],
)
def test_systemone_on_a_chat_model_is_501_before_the_body_is_read(
    text_server: LlamaServer, body: Mapping[str, Any] | bytes
) -> None:
    response = systemone(text_server, body)
    assert response.status_code == 501
    assert response.json() == NOT_A_DECISION_MODEL


def test_systemone_needs_the_api_key(text_server: LlamaServer) -> None:
    response = systemone(text_server, {"state": "hi", "questions": {}}, api_key="wrong-key")
    assert response.status_code == 401
    assert response.json() == error(401, "Invalid API Key", "authentication_error")


# -- a decision model --------------------------------------------------------------------------


def test_models_reports_decisions_output(decision_server: LlamaServer) -> None:
    assert architecture(decision_server) == DECISION_ARCHITECTURE


def test_answers_every_question_type(decision_server: LlamaServer) -> None:
    response = systemone(decision_server, {"model": ALIAS, "state": STATE, "questions": QUESTIONS})
    assert response.status_code == 200, response.text
    reply = response.json()
    assert list(reply) == ["model", "answers", "usage"]
    assert reply["model"] == ALIAS
    assert reply["usage"]["output_tokens"] == 0
    assert reply["usage"]["input_tokens"] > 0
    answers = reply["answers"]
    assert list(answers) == list(QUESTIONS)  # request order

    choice = answers["animal"]
    probs = choice["probabilities"]
    assert list(choice) == ["type", "choice", "probabilities", "confidence"]
    assert choice["type"] == "choice"
    assert list(probs) == list(QUESTIONS["animal"]["criteria"])
    assert sum(probs.values()) == pytest.approx(1.0)
    assert choice["choice"] == max(probs, key=probs.__getitem__)
    top, uniform = max(probs.values()), 1 / len(probs)
    assert choice["confidence"] == pytest.approx((top - uniform) / (1 - uniform))

    score = answers["quality"]
    levels = QUESTIONS["quality"]["criteria"]
    p = [score["probabilities"][str(i)] for i in range(len(levels))]
    assert list(score) == ["type", "score", "legend", "probabilities", "confidence"]
    assert score["type"] == "score"
    assert score["legend"] == {str(i): level for i, level in enumerate(levels)}
    assert list(score["probabilities"]) == ["0", "1", "2"]
    assert sum(p) == pytest.approx(1.0)
    assert score["score"] == pytest.approx(sum(i * pi for i, pi in enumerate(p)))
    mode = p.index(max(p))
    spread = sum(pi * abs(i - mode) for i, pi in enumerate(p))
    spread_uniform = sum(abs(i - (len(p) - 1) / 2) / len(p) for i in range(len(p)))
    assert score["confidence"] == pytest.approx(max(0.0, 1 - spread / spread_uniform))

    for name in ("rodent", "calm"):
        assert list(answers[name]) == ["type", "noul"]
        assert answers[name]["type"] == "noul"
        assert 0 < answers[name]["noul"] < 1


def test_the_request_model_is_not_checked(decision_server: LlamaServer) -> None:
    body = {"model": "no-such-model", "state": "hi", "questions": {"q": QUESTIONS["rodent"]}}
    response = systemone(decision_server, body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == ALIAS


def test_stream_is_ignored(decision_server: LlamaServer) -> None:
    body = {"state": "hi", "questions": {"q": QUESTIONS["rodent"]}, "stream": True}
    response = systemone(decision_server, body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["answers"]["q"]["type"] == "noul"


def test_answers_are_repeatable(decision_server: LlamaServer) -> None:
    body = {"state": STATE, "questions": QUESTIONS}
    first, second = systemone(decision_server, body), systemone(decision_server, body)
    assert first.status_code == second.status_code == 200
    assert flatten(second.json()["answers"]) == pytest.approx(flatten(first.json()["answers"]))


def _question(**fields: Any) -> dict[str, Any]:
    return {"state": "hi", "questions": {"q": fields}}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{}", '"state" must be provided'),
        ({"questions": {"q": QUESTIONS["rodent"]}}, '"state" must be provided'),
        ({"state": "hi"}, '"questions" must be a non-empty object'),
        ({"state": "hi", "questions": {}}, '"questions" must be a non-empty object'),
        (
            {"state": "hi", "questions": [QUESTIONS["rodent"]]},
            '"questions" must be a non-empty object',
        ),
        ({"state": "hi", "questions": {"q": "x"}}, "questions.q: must be an object"),
        (_question(type="noul"), 'questions.q: "instructions" must be provided'),
        (
            _question(type="maybe", instructions="?"),
            'questions.q: "type" must be one of: choice, score, noul',
        ),
        (
            _question(type="choice", instructions="?", criteria={}),
            'questions.q: "criteria" must be a non-empty object',
        ),
        (
            _question(type="score", instructions="?", criteria=["only"]),
            'questions.q: "criteria" must be an array of 2 to 10 levels',
        ),
        (
            _question(type="score", instructions="?", criteria=[str(i) for i in range(11)]),
            'questions.q: "criteria" must be an array of 2 to 10 levels',
        ),
        (
            _question(type="noul", instructions="?", criteria=["yes", "no"]),
            'questions.q: "criteria" must be an object',
        ),
        (
            _question(type="choice", instructions="?", criteria={f"o{i}": None for i in range(53)}),
            "questions.q: too many options (53), this model supports at most 52",
        ),
        (
            {
                "state": "hi",
                "images": ["https://a.test/a.png"],
                "questions": {"q": QUESTIONS["rodent"]},
            },
            "images must be data URLs (data:image/...;base64,... or data:audio/...;base64,...)",
        ),
    ],
    ids=[
        "empty",
        "no-state",
        "no-questions",
        "no-question",
        "questions-list",
        "question-not-object",
        "no-instructions",
        "unknown-type",
        "no-options",
        "one-level",
        "eleven-levels",
        "noul-criteria-list",
        "53-options",
        "image-url",
    ],
)
def test_invalid_requests_get_400(
    decision_server: LlamaServer, body: Mapping[str, Any] | bytes, message: str
) -> None:
    response = systemone(decision_server, body)
    assert response.status_code == 400
    assert response.json() == error(400, message, "invalid_request_error")


def test_a_malformed_body_gets_400(decision_server: LlamaServer) -> None:
    response = systemone(decision_server, b"{not json")
    assert response.status_code == 400
    detail = response.json()["error"]
    assert (detail["code"], detail["type"]) == (400, "invalid_request_error")
    assert detail["message"].startswith("[json.exception.parse_error.101] parse error")


def test_images_need_a_projector(decision_server: LlamaServer) -> None:
    body = {
        "state": "hi",
        "images": ["data:image/png;base64,iVBORw0KGgo="],
        "questions": {"q": QUESTIONS["rodent"]},
    }
    response = systemone(decision_server, body)
    assert response.status_code == 501
    assert response.json() == error(
        501,
        "This server does not support image input for decisions. "
        "For a model that supports it, start it with `--mmproj`",
        "not_supported_error",
    )


def test_an_openjev_model_still_serves_chat(decision_server: LlamaServer) -> None:
    with decision_server.client() as client:
        reply = client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_choice_temperature_divides_the_logits(
    folder: Path, decision_server: LlamaServer
) -> None:
    """p ~ exp(logit / T): with T = 0.25 the log-odds of two options are 4 times those at T = 1;
    the noul answer, whose type has no temperature, is unchanged."""
    questions = {
        "pair": {"type": "choice", "instructions": "Which?", "criteria": {"x": None, "y": None}},
        "rodent": QUESTIONS["rodent"],
    }
    model = write_decision_model(
        folder / "openjev-cold.gguf", {TYPE_KEY: "openjev", f"{TEMPERATURE_KEY}.choice": 0.25}
    )
    with running(install_for(folder, model)) as cold:
        hot_answers = systemone(decision_server, {"state": "hi", "questions": questions}).json()
        cold_answers = systemone(cold, {"state": "hi", "questions": questions}).json()

    def log_odds(answers: Any) -> float:
        probs = answers["answers"]["pair"]["probabilities"]
        return math.log(probs["x"] / probs["y"])

    assert log_odds(cold_answers) == pytest.approx(4 * log_odds(hot_answers), rel=1e-4)
    assert cold_answers["answers"]["rodent"] == pytest.approx(hot_answers["answers"]["rodent"])


# -- what the metadata must hold ---------------------------------------------------------------


@pytest.mark.parametrize("name", DECISION_TYPES)
def test_every_type_this_build_knows_loads_as_a_decision_model(folder: Path, name: str) -> None:
    metadata: dict[str, MetaValue] = {TYPE_KEY: name, HEAD_TOKENS_KEY: 64}
    model = write_decision_model(folder / f"type-{name}.gguf", metadata)
    with running(install_for(folder, model)) as server:
        assert architecture(server) == DECISION_ARCHITECTURE
        output = server.output()
    assert f"decision model type: {name}\n" in output
    embedding = "decision model reads the embeddings output, enabling embedding mode" in output
    assert embedding == (name in EMBEDDING_TYPES)


@pytest.mark.parametrize(
    ("metadata", "template", "message"),
    [
        ({TYPE_KEY: "bogus"}, OPENJEV_TEMPLATE, "unsupported decision model type: bogus"),
        ({TYPE_KEY: "OpenJev"}, OPENJEV_TEMPLATE, "unsupported decision model type: OpenJev"),
        ({TYPE_KEY: 1}, OPENJEV_TEMPLATE, "unsupported decision model type: 1"),
        ({TYPE_KEY: "openjev"}, None, 'decision model has no "systemone" template'),
        (
            {TYPE_KEY: "openjev", f"{TEMPERATURE_KEY}.choice": 0.0},
            OPENJEV_TEMPLATE,
            f"invalid decision temperature: {TEMPERATURE_KEY}.choice = 0.000000",
        ),
        ({TYPE_KEY: "laya"}, LAYA_TEMPLATE, "decision model has no valid max_head_tokens"),
    ],
    ids=["unknown-type", "type-case", "type-not-a-string", "no-template", "zero-temp", "laya"],
)
def test_bad_decision_metadata_fails_the_load(
    folder: Path, metadata: Mapping[str, MetaValue], template: str | None, message: str
) -> None:
    model = write_decision_model(folder / "bad.gguf", metadata, template)
    server = launch(install_for(folder, model))
    try:
        assert server.proc.wait(timeout=START_TIMEOUT) == 1
    finally:
        server.stop()
    output = server.output()
    assert f"failed to init decision model: {message}\n" in output
    assert "exiting due to model loading error" in output


def test_the_type_key_is_read_under_the_architecture_only(folder: Path) -> None:
    model = write_decision_model(folder / "general.gguf", {"general.decision.type": "openjev"})
    with running(install_for(folder, model)) as server:
        assert architecture(server) == TEXT_ARCHITECTURE
        response = systemone(server, {"state": "hi", "questions": {"q": QUESTIONS["rodent"]}})
        assert response.status_code == 501
        assert response.json() == NOT_A_DECISION_MODEL


# -- laya: one question's prompt in one batch --------------------------------------------------


def launch_with_batch(install: Install, batch: int) -> LlamaServer:
    """llama-server as `launch` starts it, plus `-b N -ub N` (CapyCTL sizes both for laya)."""
    port = free_port()
    log_path = install.model.parent / f"llama-server-{port}.log"
    argv = [
        str(install.llama_server),
        *("-m", str(install.model), "--host", "127.0.0.1", "--port", str(port)),
        *("--alias", ALIAS, "-c", "2048", "-np", "1", "-b", str(batch), "-ub", str(batch)),
        *("--metrics", "--no-webui", "-ngl", "0", "--jinja", "--reasoning-format", "none"),
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=clean_env(LLAMA_API_KEY=API_KEY)
        )
    return LlamaServer(proc, f"http://127.0.0.1:{port}", log_path)


def test_a_laya_prompt_must_fit_the_batch(folder: Path) -> None:
    metadata: dict[str, MetaValue] = {TYPE_KEY: "laya", HEAD_TOKENS_KEY: 64}
    model = write_decision_model(folder / "laya.gguf", metadata, LAYA_TEMPLATE)
    server = launch_with_batch(install_for(folder, model), batch=64)
    try:
        wait_for(server.healthy, timeout=START_TIMEOUT, what="llama-server's /health to be 200")
        assert architecture(server) == DECISION_ARCHITECTURE
        question = {"q": QUESTIONS["animal"]}
        short = systemone(server, {"state": "hi", "questions": question})
        assert short.status_code == 200, short.text
        assert list(short.json()["answers"]["q"]["probabilities"]) == ["capybara", "llama", "bear"]
        long = systemone(server, {"state": "capy " * 100, "questions": question})
    finally:
        server.stop()
    assert long.status_code == 400
    detail = long.json()["error"]
    assert (detail["code"], detail["type"]) == (400, "invalid_request_error")
    assert re.fullmatch(
        r"the question and its options \(\d+ tokens\) are too large to process\. "
        r"increase the batch size \(current batch size: 64\)",
        detail["message"],
    )
