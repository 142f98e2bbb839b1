"""System One decisions (`POST /v1/systemone`) on the simulated SGLang, llama.cpp and vLLM:
answers, names, refusals, what each engine loaded, and hang-ups."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from decisionmodels import asked, decision_folder, decision_gguf
from engines.simulator.helpers import (
    FAST,
    HELLO,
    Engine,
    Engines,
    Servers,
    send_and_hang_up,
)
from enginesim import Behaviour, DisconnectLag, Faults
from enginesim.decisions import confidence, gguf_decision_type
from enginesim.engine import Engine as SimEngine
from enginesim.engine import Work
from support import wait_for

SGLANG = "0.5.22"
LLAMA = 6500
VLLM = "0.32.0"
STATE = {"ticket": 42, "text": "The invoice is wrong again!"}
QUESTIONS: dict[str, Any] = {
    "topic": asked(
        "choice",
        "What is the ticket about?",
        {"billing": "Money matters", "bug": None, "praise": "Kind words"},
    ),
    "urgency": asked("score", "How urgent is it?", ["not urgent", "soon", "now"]),
    "angry": asked("noul", "Is the writer angry?", {"true": "angry", "false": "calm"}),
}
# Slow enough to act on a decision while it runs; SGLang aborts other hung-up requests soon.
SLOW_DECISIONS = FAST.model_copy(
    update={
        "decision_seconds": 1.5,
        "faults": Faults(disconnect_abort_lag=DisconnectLag(non_stream=0.1, stream=0.1)),
    }
)


def ask(model: str, state: Any = None, **questions: Any) -> dict[str, Any]:
    return {"model": model, "state": STATE if state is None else state, "questions": questions}


def check_answers(body: dict[str, Any], questions: dict[str, Any]) -> None:
    """Each answer has its type's fields; probabilities sum to 1; the choice is the most
    likely option; the score is the expected level; confidence is in [0, 1]."""
    answers = body["answers"]
    assert list(answers) == list(questions)
    for qid, question in questions.items():
        answer = answers[qid]
        assert answer["type"] == question["type"], qid
        if question["type"] == "noul":
            assert 0.0 < answer["noul"] < 1.0
            continue
        assert 0.0 <= answer["confidence"] <= 1.0, qid
        probs = answer["probabilities"]
        assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-9), qid
        if question["type"] == "choice":
            assert list(probs) == list(question["criteria"])
            assert answer["choice"] == max(probs, key=probs.__getitem__)
        else:
            levels = question["criteria"]
            assert answer["legend"] == {str(i): text for i, text in enumerate(levels)}
            assert list(probs) == [str(i) for i in range(len(levels))]
            expected = sum(int(index) * p for index, p in probs.items())
            assert math.isclose(answer["score"], expected, abs_tol=1e-9)


def decide(engine: Engine, body: dict[str, Any]) -> httpx.Response:
    return engine.post("/v1/systemone", json=body)


def start_sglang(engines: Engines, model: Path, behaviour: Behaviour, *extra: str) -> Engine:
    """SGLang from `model` (it may still be loading)."""
    with_model = replace(engines, model=model)
    return with_model.start("sglang", SGLANG, behaviour, "--skip-server-warmup", *extra)


def start_llama(engines: Engines, model: Path, behaviour: Behaviour, *extra: str) -> Engine:
    """llama-server serving `model`."""
    engine = engines.start_llama(LLAMA, behaviour, model, *extra)
    engine.wait_status(200)
    return engine


@pytest.fixture(scope="module")
def decider(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """SGLang serving a decision checkpoint (`decision_config.json`) as `decider`."""
    model = decision_folder(tmp_path_factory.mktemp("models") / "decider")
    extra = ("--served-model-name", "decider", "--enable-metrics", "--skip-server-warmup")
    with servers.python("sglang-decider", "sglang", SGLANG, FAST, *extra, model=model) as engine:
        yield engine


@pytest.fixture(scope="module")
def judge(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """llama-server serving an OpenJev GGUF as `judge`."""
    model = decision_gguf(tmp_path_factory.mktemp("models") / "openjev.gguf", "openjev")
    extra = ("--alias", "judge", "--metrics")
    with servers.llama("llama-judge", LLAMA, FAST, *extra, model=model) as engine:
        yield engine


# The pure parts ----------------------------------------------------------------------------


def test_confidence_is_one_for_a_sure_answer_and_zero_for_a_flat_one() -> None:
    assert confidence([1.0, 0.0, 0.0]) == 1.0
    assert math.isclose(confidence([0.25] * 4), 0.0, abs_tol=1e-12)
    assert 0.0 < confidence([0.7, 0.3]) < 1.0


def test_a_decision_runs_its_time_and_no_abort_by_rid_reaches_one_that_runs_to_its_end() -> None:
    async def run() -> None:
        engine = SimEngine(FAST, 4, lambda reason: None)
        kept = Work("kept", 1, [], "stop", prefill_seconds=0.2, runs_to_end=True)
        plain = Work("plain", 1, [], "stop", prefill_seconds=0.2)
        engine.submit(kept)
        engine.submit(plain)
        assert (engine.abort_rid("kept"), engine.abort_rid("plain")) == (0, 1)
        assert list(engine.running.values()) == [kept]
        await asyncio.wait_for(kept.done.wait(), 2)
        assert (kept.finish, plain.finish, kept.completion_tokens) == ("stop", "abort", 0)
        assert kept.finished_at is not None
        assert kept.finished_at - kept.created >= 0.2

    asyncio.run(run())


# SGLang ------------------------------------------------------------------------------------


def test_sglang_answers_every_type_the_same_way_each_time(decider: Engine) -> None:
    first = decide(decider, ask("decider", **QUESTIONS))
    assert first.status_code == 200, first.text
    body = first.json()
    check_answers(body, QUESTIONS)
    assert body["model"] == "decider"
    assert body["usage"]["output_tokens"] == 0
    assert body["usage"]["decision_count"] == 3
    assert body["usage"]["input_tokens"] > 0
    assert not any("x_label_mass" in answer for answer in body["answers"].values())
    assert decide(decider, ask("decider", **QUESTIONS)).json() == body
    as_text = decide(decider, ask("decider", state="The invoice is wrong again!", **QUESTIONS))
    assert as_text.json()["answers"] != body["answers"]


def test_sglang_takes_the_jev_aliases_and_refuses_other_names(decider: Engine) -> None:
    for alias in ("jev-latest", "jev-preview"):
        named = decide(decider, ask(alias, angry=QUESTIONS["angry"]))
        assert (named.status_code, named.json()["model"]) == (200, alias)
    unknown = decide(decider, ask("other", angry=QUESTIONS["angry"]))
    assert unknown.status_code == 404
    assert (unknown.json()["object"], unknown.json()["code"]) == ("error", 404)
    bare = httpx.post(f"{decider.base}/v1/systemone", json=ask("decider", **QUESTIONS))
    assert bare.status_code == 401


MANY_OPTIONS = {f"o{i}": None for i in range(256)}


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"model": "decider", "state": "s"}, ["body", "questions"]),
        ({"state": "s", "questions": {"q": QUESTIONS["angry"]}}, ["body", "model"]),
        (ask("decider"), ["body", "questions"]),
        (ask("decider", q={"type": "choice", "criteria": {"one": None}}), ["body", "questions"]),
        (ask("decider", q={"type": "score", "criteria": [str(i) for i in range(11)]}), None),
        (ask("decider", q={"type": "maybe", "instructions": "?"}), None),
        (ask("decider", q={"type": "noul", "instruction": "typo"}), None),
        (ask("decider", q={"type": "noul"}), None),
        (ask("decider", q={"type": "choice", "criteria": MANY_OPTIONS}), None),
        (ask("decider", **{f"q{i}": QUESTIONS["angry"] for i in range(17)}), None),
        (ask("decider", state=12, q=QUESTIONS["angry"]), ["body", "state"]),
    ],
)
def test_sglang_bad_input_is_a_422_detail_list(
    decider: Engine, body: dict[str, Any], where: list[str] | None
) -> None:
    refused = decide(decider, body)
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"]
    assert detail
    assert all({"loc", "msg", "type"} <= set(problem) for problem in detail)
    assert all(problem["loc"][0] == "body" for problem in detail)
    if where is not None:
        assert detail[0]["loc"][: len(where)] == where


def test_sglang_reads_labels_of_a_chat_model(engines: Engines, tmp_path: Path) -> None:
    model = decision_folder(tmp_path / "chat", head="none")
    engine = start_sglang(engines, model, FAST)
    engine.wait_status(200)
    answered = decide(engine, ask(str(model), **QUESTIONS))
    assert answered.status_code == 200, answered.text
    check_answers(answered.json(), QUESTIONS)
    for answer in answered.json()["answers"].values():
        assert 0.9 <= answer["x_label_mass"] < 1.0


def test_sglang_refuses_setups_a_checkpoint_cannot_answer_under(
    engines: Engines, tmp_path: Path
) -> None:
    model = decision_folder(tmp_path / "clef", head="joint_head")
    flags = ("--speculative-algorithm", "EAGLE", "--chat-template", "t.jinja")
    engine = start_sglang(engines, model, FAST, *flags)
    engine.wait_status(200)
    refused = decide(engine, ask(str(model), **QUESTIONS))
    assert refused.status_code == 400
    assert "--chat-template" in refused.json()["message"]
    chat = engine.post("/v1/chat/completions", json={"messages": HELLO})
    assert chat.status_code == 200


def test_sglang_decision_checkpoint_with_lmcache_and_no_radix_cache_fails_at_start(
    engines: Engines, tmp_path: Path
) -> None:
    model = decision_folder(tmp_path / "decider")
    flags = ("--enable-lmcache", "--disable-radix-cache")
    engine = start_sglang(engines, model, FAST, *flags)
    assert engine.wait_exit() == 1
    assert "--enable-lmcache cannot be used with --disable-radix-cache" in engine.output()
    allowed = start_sglang(engines, model, FAST, "--disable-radix-cache")
    allowed.wait_status(200)


@pytest.fixture
def slow_decider(engines: Engines, tmp_path: Path) -> tuple[Engine, str]:
    """SGLang whose decisions take 1.5 s each, with metrics and a memory saver."""
    model = decision_folder(tmp_path / "decider")
    extra = ("--enable-metrics", "--enable-memory-saver")
    engine = start_sglang(engines, model, SLOW_DECISIONS, *extra)
    engine.wait_status(200)
    return engine, str(model)


def test_sglang_runs_a_hung_up_decision_to_its_end(slow_decider: tuple[Engine, str]) -> None:
    """sgl-project/sglang#45842: the hang-up and an abort by rid leave it running."""
    engine, model = slow_decider
    running = "sglang:num_running_reqs"
    sent = time.monotonic()
    sock = send_and_hang_up(engine.port, "/v1/systemone", ask(model, **QUESTIONS), None)
    wait_for(lambda: engine.metric(running) == 1, 5, "the decision to run")
    sock.close()
    for rid in ("anything", "systemone"):
        assert engine.post("/abort_request", json={"rid": rid}).status_code == 200
    wait_for(lambda: engine.metric(running) == 0, 5, "the decision's end")
    assert time.monotonic() - sent >= SLOW_DECISIONS.decision_seconds
    assert engine.metric("sglang:num_aborted_requests_total") == 0


def test_sglang_holds_decisions_while_its_memory_is_released(
    slow_decider: tuple[Engine, str],
) -> None:
    engine, model = slow_decider
    assert engine.post("/release_memory_occupation").status_code == 200
    answers: list[httpx.Response] = []
    asking = threading.Thread(
        target=lambda: answers.append(decide(engine, ask(model, **QUESTIONS)))
    )
    asking.start()
    wait_for(lambda: engine.metric("sglang:num_queue_reqs") == 1, 5, "the decision to wait")
    assert engine.metric("sglang:num_running_reqs") == 0
    assert engine.post("/resume_memory_occupation").status_code == 200
    asking.join(timeout=10)
    assert answers[0].status_code == 200


# llama.cpp ---------------------------------------------------------------------------------


def test_llamacpp_answers_every_type_the_same_way_each_time(judge: Engine) -> None:
    first = decide(judge, ask("judge", **QUESTIONS))
    assert first.status_code == 200, first.text
    body = first.json()
    check_answers(body, QUESTIONS)
    assert body["usage"] == {"input_tokens": body["usage"]["input_tokens"], "output_tokens": 0}
    assert decide(judge, ask("judge", **QUESTIONS)).json() == body


def test_llamacpp_answers_any_model_name_under_its_alias(judge: Engine) -> None:
    """As llama.cpp build 11549 does: the request's model is not checked, and a noul answer
    carries no confidence."""
    for name in ("judge", "jev-latest", "other"):
        named = decide(judge, ask(name, angry=QUESTIONS["angry"]))
        assert (named.status_code, named.json()["model"]) == (200, "judge")
        assert "confidence" not in named.json()["answers"]["angry"]
    unnamed = decide(judge, {"state": "hi", "questions": {"q": QUESTIONS["angry"]}})
    assert (unnamed.status_code, unnamed.json()["model"]) == (200, "judge")
    assert httpx.post(f"{judge.base}/v1/systemone", json=ask("judge")).status_code == 401


def test_llamacpp_bad_input_is_a_400_and_openjev_takes_52_options(judge: Engine) -> None:
    for body in (
        {"model": "judge", "state": "s"},
        ask("judge", q={"type": "score", "criteria": ["only one"]}),
        ask("judge", q={"type": "choice", "criteria": {f"o{i}": None for i in range(53)}}),
    ):
        refused = decide(judge, body)
        assert refused.status_code == 400, body
        assert refused.json()["error"]["type"] == "invalid_request_error"
    assert "at most 52 options" in refused.json()["error"]["message"]
    most = ask("judge", q={"type": "choice", "criteria": {f"o{i}": None for i in range(52)}})
    assert decide(judge, most).status_code == 200
    images = {**ask("judge", **QUESTIONS), "files": ["data:image/png;base64,AAAA"]}
    assert decide(judge, images).status_code == 501


def test_llamacpp_lists_decisions_and_still_chats(judge: Engine) -> None:
    for path in ("/v1/models", "/models"):
        card = httpx.get(judge.base + path).json()["data"][0]
        assert card["architecture"]["output_modalities"] == ["decisions"]
    chat = judge.post("/v1/chat/completions", json={"messages": HELLO})
    assert chat.json()["choices"][0]["message"]["content"] == FAST.answer


def test_llamacpp_text_model_answers_501(engines: Engines, tmp_path: Path) -> None:
    model = decision_gguf(tmp_path / "chat.gguf", decision=None)
    engine = start_llama(engines, model, FAST)
    refused = decide(engine, ask(str(model), **QUESTIONS))
    assert refused.status_code == 501
    assert refused.json()["error"]["message"] == "This model is not a decision model"
    card = engine.get("/v1/models").json()["data"][0]
    assert card["architecture"] == {"input_modalities": ["text"], "output_modalities": ["text"]}


def test_a_file_that_is_not_gguf_declares_no_decision_type(tmp_path: Path) -> None:
    (tmp_path / "text.gguf").write_bytes(b"not a gguf file")
    assert gguf_decision_type(tmp_path / "text.gguf") is None
    assert gguf_decision_type(decision_gguf(tmp_path / "laya.gguf", "laya", "lfm2")) == "laya"


@pytest.fixture
def clef(engines: Engines, tmp_path: Path) -> Engine:
    """llama-server serving a Clef GGUF with a 64-token physical batch (-b 48 is smaller)."""
    model = decision_gguf(tmp_path / "clef.gguf", "clef")
    extra = ("--metrics", "-np", "1", "-ub", "64", "-b", "48")
    return start_llama(engines, model, SLOW_DECISIONS, *extra)


def test_llamacpp_clef_serves_only_decisions_that_fit_one_batch(clef: Engine) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": HELLO}),
        ("/v1/completions", {"prompt": "Hello"}),
    ):
        refused = clef.post(path, json=body)
        assert refused.status_code == 501, path
        assert refused.json()["error"]["type"] == "not_supported_error"
    card = clef.get("/v1/models").json()["data"][0]
    assert card["architecture"]["output_modalities"] == ["decisions"]
    model = clef.get("/props").json()["model_path"]
    too_long = decide(clef, ask(model, state="word " * 200, angry=QUESTIONS["angry"]))
    assert too_long.status_code == 400
    message = too_long.json()["error"]["message"]
    assert message.startswith("the question and its options (")
    assert message.endswith("increase the batch size (current batch size: 48)")


def test_llamacpp_drops_a_hung_up_decision_at_once(clef: Engine) -> None:
    model = clef.get("/props").json()["model_path"]
    processing = "llamacpp:requests_processing"
    sock = send_and_hang_up(clef.port, "/v1/systemone", ask(model, angry=QUESTIONS["angry"]), None)
    wait_for(lambda: clef.metric(processing) == 1, 5, "the decision to run")
    closed = time.monotonic()
    sock.close()
    wait_for(lambda: clef.metric(processing) == 0, 5, "the decision to stop")
    assert time.monotonic() - closed < SLOW_DECISIONS.decision_seconds


# vLLM --------------------------------------------------------------------------------------


def start_vllm(engines: Engines, version: str, *extra: str) -> Engine:
    flags = ("--host", "127.0.0.1", "--gpu-memory-utilization", "0.3")
    engine = engines.start("vllm", version, FAST, *flags, *extra)
    engine.wait_status(200)
    return engine


def test_vllm_reads_the_text_output_from_0_32_with_a_logprobs_mode(engines: Engines) -> None:
    served = start_vllm(engines, VLLM, "--served-model-name", "m")
    answered = decide(served, ask("m", **QUESTIONS))
    assert answered.status_code == 200, answered.text
    body = answered.json()
    check_answers(body, QUESTIONS)
    assert body["object"] == "structured_decision"
    assert body["id"].startswith("decision-")
    assert set(body["diagnostics"]) == set(QUESTIONS)
    assert all(d["argmax_is_label"] is True for d in body["diagnostics"].values())
    assert decide(served, ask("other", **QUESTIONS)).status_code == 404
    logits = start_vllm(engines, VLLM, "--logprobs-mode", "raw_logits")
    refused = decide(logits, ask(str(engines.model), **QUESTIONS))
    assert refused.status_code == 501
    assert "--logprobs-mode" in refused.json()["error"]["message"]
    older = start_vllm(engines, "0.17.0")
    assert decide(older, ask(str(engines.model), **QUESTIONS)).status_code == 404
