"""Decision models (`api: decisions`) through a real standalone role, with the simulator as
SGLang 0.5.22, llama.cpp and vLLM 0.32.0, and the openai SDK as the client (its `decisions`
resource, and raw System One through its own HTTP client): every question type in both
formats on both engines, `/v1/models` marking them, the refusals (vLLM, a model that is no
decision model, LMCache required, the wrong route either way, limits, images), a hang-up on
each engine and how it settles, and a decision model and a chat model taking turns on one
simulated GPU."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import yaml

from cluster import FOURTEEN, SMALL, Cluster
from decisionmodels import DECISIONS, SYSTEM_ONE, decision_folder, decision_gguf, unnamed
from enginesim.behaviour import Behaviour
from enginesim.install import install_llama_server, install_python_engine
from support import cancel, wait_for

CONTEXT = {"context_length": 4096, **SMALL}
STATE = "Ticket 4411: the app crashes on every start since the update."
QUESTIONS = unnamed(DECISIONS, "team")


@pytest.fixture(scope="module")
def engines(one_gpu: Cluster) -> dict[str, str]:
    """SGLang 0.5.22 and llama.cpp (each answering decisions quickly, and in 6 s), and vLLM
    0.32.0, registered; decision models on disk beside the role's models."""
    fast = Behaviour(load_seconds=0.3, tokens_per_second=200, decision_seconds=0.05)
    slow = fast.model_copy(update={"decision_seconds": 6.0})
    root = one_gpu.root / "e"
    installs = {
        "sg22": install_python_engine(root / "sg22", "sglang", "0.5.22", fast),
        "sgslow": install_python_engine(root / "sgslow", "sglang", "0.5.22", slow),
        "v32": install_python_engine(root / "v32", "vllm", "0.32.0", fast),
        "llamad": install_llama_server(root / "llamad", 6500, fast),
        "llamaslow": install_llama_server(root / "llamaslow", 6500, slow),
    }
    for name, path in installs.items():
        one_gpu.ok("engine", "add", str(path), "--name", name)
    models = one_gpu.root / "models"
    decision_folder(models / "judge", "decision_config")
    decision_folder(models / "clef", "joint_head")
    decision_folder(models / "chatty", "none")
    decision_gguf(models / "kev.gguf", "kev")
    decision_gguf(models / "plain.gguf", None)
    return {name: name for name in installs}


def deploy_decisions(cluster: Cluster, name: str, engine: str, model: str, **fields: Any) -> None:
    config = CONTEXT if engine.startswith("llama") else SMALL
    fields.setdefault("engine_config", config)
    cluster.deploy(name, engine=engine, model=model, api="decisions", **fields)


def system_one(cluster: Cluster, model: str, body: dict[str, Any]) -> dict[str, Any]:
    """A System One request through the SDK's own HTTP client (the SDK has no resource)."""
    found = cluster.openai().post("/systemone", body={"model": model, **body}, cast_to=object)
    assert isinstance(found, dict)
    return found


def refused(cluster: Cluster, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    answer = httpx.post(f"{cluster.base_url}{path}", json=body, headers=headers, timeout=60)
    error = answer.json()["error"]
    assert isinstance(error, dict)
    return answer.status_code, error


def test_every_question_type_in_both_formats_on_sglang_and_llamacpp(
    cluster: Cluster, engines: dict[str, str]
) -> None:
    deploy_decisions(cluster, "judge", engines["sg22"], "judge")
    deploy_decisions(cluster, "kev", engines["llamad"], "kev.gguf", residency="restart_only")
    cluster.deploy("chat", model="small", engine_config=SMALL)
    client = cluster.openai()
    for model in ("judge", "kev"):
        decision = client.decisions.create(model=model, input=STATE, questions=QUESTIONS)
        assert decision.model == model
        answers = decision.answers
        assert [a.type for a in answers] == ["predicate", "choice", "score", "choice"]
        assert [a.name for a in answers] == ["bug", None, "urgency", "reply"]
        predicate, team, urgency, reply = (a.model_dump() for a in answers)
        assert 0 <= predicate["probability"] <= 1
        assert [p["value"] for p in team["probabilities"]] == ["mobile", "web"], "caller's order"
        assert team["choice"] in ("mobile", "web")
        assert math.isclose(sum(p["probability"] for p in team["probabilities"]), 1, rel_tol=1e-6)
        assert 0 <= team["confidence"] <= 1
        levels = urgency["probabilities"]
        assert [(p["value"], p["label"]) for p in levels] == [
            (0, "low"),
            (1, "medium"),
            (2, "high"),
        ]
        expected = sum(p["value"] * p["probability"] for p in levels)
        assert math.isclose(urgency["score"], expected, rel_tol=1e-6), "the expected level"
        assert reply["choice"] in (True, False), "booleans come back as booleans"
        assert [p["value"] for p in reply["probabilities"]] == [True, False]
        assert decision.usage.output_tokens == 0
        assert decision.usage.input_tokens > 0
        again = client.decisions.create(model=model, input=STATE, questions=QUESTIONS)
        assert again.answers == decision.answers, "one prefill, the same probabilities"
        raw = system_one(cluster, model, SYSTEM_ONE)
        assert raw["model"] == model, "the public id, not the engine's served name"
        assert set(raw["answers"]) == {"bug", "team", "urgency"}
        assert raw["answers"]["bug"]["type"] == "noul"
        assert 0 <= raw["answers"]["bug"]["noul"] <= 1
        assert raw["answers"]["team"]["choice"] in ("mobile", "web")
        assert set(raw["answers"]["urgency"]["probabilities"]) == {"0", "1", "2"}
    assert re.search(r"^api\s+decisions$", cluster.ok("status", "deployment", "judge"), re.M)
    assert re.search(r"^api\s+chat$", cluster.ok("status", "deployment", "chat"), re.M)
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    listed = httpx.get(f"{cluster.base_url}/models", headers=headers, timeout=10).json()["data"]
    marks = {entry["id"]: entry.get("architecture") for entry in listed}
    assert marks == {
        "judge": {"output_modalities": ["decisions"]},
        "kev": {"output_modalities": ["decisions"]},
        "chat": None,
    }


def test_decision_refusals(cluster: Cluster, engines: dict[str, str]) -> None:
    deploy_decisions(cluster, "judge", engines["sg22"], "judge")
    cluster.deploy("chat", model="small", engine_config=SMALL)
    client = cluster.openai()
    with pytest.raises(openai.BadRequestError) as wrong:
        client.chat.completions.create(model="judge", messages=[{"role": "user", "content": "x"}])
    assert "is a decision model (api: decisions)" in str(wrong.value)
    assert "POST /v1/decisions or /v1/systemone" in str(wrong.value)
    status, error = refused(
        cluster, "/decisions", {"model": "chat", "input": "x", "questions": QUESTIONS}
    )
    assert (status, error["code"]) == (400, "wrong_api")
    assert "is a chat model (api: chat)" in error["message"]
    status, error = refused(cluster, "/systemone", {"model": "chat", **SYSTEM_ONE})
    assert (status, error["code"]) == (400, "wrong_api")
    twice = [QUESTIONS[0], {**QUESTIONS[0], "instructions": "again?"}]
    with pytest.raises(openai.BadRequestError, match="question names bug are given twice"):
        client.decisions.create(model="judge", input=STATE, questions=twice)
    many: list[Any] = [{"type": "predicate", "instructions": f"Is {i} odd?"} for i in range(17)]
    with pytest.raises(openai.BadRequestError, match="17 questions; sglang takes at most 16"):
        client.decisions.create(model="judge", input=STATE, questions=many)
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]
    status, error = refused(
        cluster, "/decisions", {"model": "judge", "input": image, "questions": QUESTIONS}
    )
    assert (status, error["code"]) == (400, "unsupported_parameter")
    status, error = refused(
        cluster, "/systemone", {"model": "judge", "state": "x", "questions": {}}
    )
    assert (status, error["code"]) == (400, "invalid_request")
    # Refused when declared: nothing is stored, and no engine ever starts for them.
    declared: list[tuple[str, str, str, dict[str, Any], int, str]] = [
        ("vl", engines["v32"], "judge", {}, 5, "error [capability_missing:decisions]"),
        ("no", engines["sg22"], "chatty", {}, 5, "error [not_a_decision_model]"),
        ("plain", engines["llamad"], "plain.gguf", {"engine_config": CONTEXT}, 5,
         "error [not_a_decision_model]"),
        ("cached", engines["sg22"], "judge", {"lmcache": "required"}, 5,
         "error [lmcache_unavailable:decisions]"),
    ]  # fmt: skip
    for name, engine, model, fields, exit_code, said in declared:
        document = cluster.root / f"{name}.yaml"
        written = {"name": name, "engine": engine, "model": model, "api": "decisions"}
        document.write_text(yaml.safe_dump({**written, "engine_config": SMALL, **fields}))
        result = cluster.cli("deploy", "model", "--file", str(document))
        assert result.returncode == exit_code, (name, result.stderr)
        assert said in result.stderr, (name, result.stderr)
        assert cluster.instance(name) is None
    names = {row["name"] for row in json.loads(cluster.ok("list", "deployments", "--json"))}
    assert names == {"judge", "chat"}
    # The Clef head is a decision model too, and LMCache auto runs without it.
    deploy_decisions(cluster, "clef", engines["sg22"], "clef", lmcache="auto")
    (binding,) = cluster.status("clef")["bindings"]
    assert str(binding["lmcache"]).endswith("[decisions]")
    assert system_one(cluster, "clef", SYSTEM_ONE)["model"] == "clef"


def _hang_up(cluster: Cluster, model: str, engine_running: Callable[[], int]) -> None:
    """Send a decision request and hang up once the engine works on it."""

    async def cut() -> None:
        headers = {"Authorization": f"Bearer {cluster.api_key}"}
        body = {"model": model, "input": STATE, "questions": QUESTIONS}
        async with httpx.AsyncClient(base_url=cluster.base_url, headers=headers) as http:
            task = asyncio.create_task(http.post("/decisions", json=body, timeout=60))
            await asyncio.to_thread(
                wait_for,
                lambda: engine_running() == 1,
                timeout=10,
                what="the engine to get the request",
            )
            await cancel(task)

    asyncio.run(cut())


LLAMA_RUNNING = re.compile(r"^llamacpp:requests_processing(?:\{[^}]*\})? (\S+)$", re.M)


def llama_running(cluster: Cluster, name: str) -> int:
    found = LLAMA_RUNNING.search(cluster.engine_metrics(name))
    assert found is not None, "llama.cpp reports its running requests"
    return int(float(found[1]))


def test_a_hang_up_closes_the_engine_connection_and_settles_as_each_engine_allows(
    cluster: Cluster, engines: dict[str, str]
) -> None:
    """SGLang runs a hung-up decision request to its end (sglang#45842): it counts until the
    next stop. llama.cpp drops it with its connection: it settles once the engine reads idle."""
    deploy_decisions(cluster, "slowjudge", engines["sgslow"], "judge")
    cluster.start("slowjudge")
    _hang_up(cluster, "slowjudge", lambda: cluster.engine_running("slowjudge"))
    assert cluster.engine_running("slowjudge") == 1, "the engine still works on it"
    requests = cluster.status("slowjudge")["requests"]
    assert requests["settle_at_stop"] == 1, "cut before its answer, and SGLang keeps it"
    assert requests["running"] == 1
    wait_for(
        lambda: cluster.engine_running("slowjudge") == 0,
        timeout=10,
        what="SGLang to finish the request on its own",
    )
    assert cluster.status("slowjudge")["requests"]["settle_at_stop"] == 1, "until the next stop"
    cluster.ok("stop", "deployment", "slowjudge", "--wait")
    cluster.start("slowjudge")
    assert cluster.status("slowjudge")["requests"]["settle_at_stop"] == 0, "the stop settled it"

    deploy_decisions(cluster, "slowkev", engines["llamaslow"], "kev.gguf", residency="restart_only")
    cluster.start("slowkev")
    _hang_up(cluster, "slowkev", lambda: llama_running(cluster, "slowkev"))
    wait_for(
        lambda: llama_running(cluster, "slowkev") == 0,
        timeout=2,
        what="llama.cpp to drop the request",
    )
    wait_for(
        lambda: cluster.status("slowkev")["requests"]["running"] == 0,
        timeout=30,
        what="the cut request to settle once the engine reads idle",
    )
    assert cluster.status("slowkev")["requests"]["settle_at_stop"] == 0


def test_request_ids_metrics_and_the_deadline_work_as_for_chat(
    cluster: Cluster, engines: dict[str, str]
) -> None:
    # Names of their own: the router's counters outlive a deleted deployment.
    deploy_decisions(cluster, "counted", engines["sg22"], "judge")
    deploy_decisions(cluster, "late", engines["sgslow"], "judge", request_deadline="2s")
    raw = cluster.openai().decisions.with_raw_response.create(
        model="counted", input=STATE, questions=QUESTIONS
    )
    assert re.fullmatch(r"decision-[0-9a-f]{24}", raw.headers["x-capyctl-request-id"])
    assert raw.parse().answers[0].type == "predicate"
    cluster.start("late")
    status, error = refused(
        cluster, "/decisions", {"model": "late", "input": STATE, "questions": QUESTIONS}
    )
    assert (status, error["code"]) == (503, "unavailable"), "6 s of work, a 2 s deadline"
    assert "no answer in time (deadline)" in error["message"]
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    text = httpx.get(f"{cluster.base_url.removesuffix('/v1')}/metrics", headers=headers).text
    assert 'capyctl_requests_total{deployment="counted",outcome="ok",route="decisions"} 1.0' in text
    assert (
        'capyctl_requests_total{deployment="late",outcome="deadline",route="decisions"} 1.0' in text
    )
    assert 'capyctl_time_to_first_token_seconds_count{deployment="counted"} 1.0' in text


def test_a_decision_model_and_a_chat_model_take_turns_on_one_gpu(
    cluster: Cluster, engines: dict[str, str]
) -> None:
    """Each takes 14 GiB of the 24 GiB GPU: a request for one parks the other."""
    deploy_decisions(cluster, "judge", engines["sg22"], "judge", engine_config=FOURTEEN)
    cluster.deploy("chat", model="m14", engine_config=FOURTEEN)
    client = cluster.openai()
    for turn in range(2):
        decision = client.decisions.create(model="judge", input=STATE, questions=QUESTIONS[:1])
        assert decision.answers[0].type == "predicate"
        if turn:
            assert cluster.state("chat") == "parked", "the chat model made room"
        chat = client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content
        assert cluster.state("judge") == "parked", "the decision model made room"
    states = [t for t in cluster.transitions("judge") if t[1] in ("parked", "ready")]
    assert [t[1] for t in states].count("parked") >= 2, states
