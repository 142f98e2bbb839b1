"""A decision model on the real llama.cpp (xllamacpp's build of llama-server, on the CPU),
end to end on a standalone role: the tiny GGUF marked `openjev` deployed with
`api: decisions`, answered through the openai SDK in both formats, listed as a decision model,
started with its batch at the context length and through its canary; a plain GGUF refused at
deploy, and a chat request to the decision model refused."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from cluster import SMALL, Cluster, running
from decisionmodels import DECISIONS, SYSTEM_ONE, unnamed
from engines.llamacpp.llama_server import write_wrapper
from engines.llamacpp.test_real_llamacpp_decisions import TYPE_KEY, write_decision_model
from engines.llamacpp.tinygguf import write_tiny_model
from support import processes_mentioning

CONTEXT = 512
STATE = "Ticket 4411: the capybara app crashes on every start since the update."
QUESTIONS = unnamed(DECISIONS, "reply")


@pytest.fixture(scope="module")
def role() -> Iterator[Cluster]:
    with running("llamacpp-decisions") as found:
        yield found


@pytest.fixture(scope="module")
def llama(role: Cluster) -> str:
    """The real llama-server, registered; its name."""
    wrapper = write_wrapper(role.root / "llama.cpp")
    role.ok("engine", "add", str(wrapper), "--name", "llamacpp")
    return "llamacpp"


@pytest.fixture(scope="module")
def jev(role: Cluster, llama: str) -> Path:
    """`jev` deployed on the real llama-server: the tiny GGUF marked `openjev`; its path."""
    model = write_decision_model(role.root / "openjev.gguf", {TYPE_KEY: "openjev"})
    role.deploy(
        "jev",
        engine=llama,
        model=str(model),
        api="decisions",
        residency="restart_only",
        engine_config={"context_length": CONTEXT, **SMALL},
    )
    return model


def total(probabilities: list[dict[str, Any]]) -> float:
    return math.fsum(p["probability"] for p in probabilities)


def test_the_real_engine_answers_decisions_in_both_formats(role: Cluster, jev: Path) -> None:
    client = role.openai()
    decision = client.decisions.create(model="jev", input=STATE, questions=QUESTIONS)
    assert decision.model == "jev"
    assert [a.type for a in decision.answers] == ["predicate", "choice", "score", "choice"]
    assert [a.name for a in decision.answers] == ["bug", "team", "urgency", None]
    predicate, team, urgency, reply = (a.model_dump() for a in decision.answers)
    assert 0 < predicate["probability"] < 1
    assert [p["value"] for p in team["probabilities"]] == ["mobile", "web"], "the caller's order"
    assert team["choice"] in ("mobile", "web")
    assert total(team["probabilities"]) == pytest.approx(1)
    levels = urgency["probabilities"]
    assert [(p["value"], p["label"]) for p in levels] == [(0, "low"), (1, "medium"), (2, "high")]
    assert total(levels) == pytest.approx(1)
    expected = math.fsum(p["value"] * p["probability"] for p in levels)
    assert urgency["score"] == pytest.approx(expected), "the expected level index"
    assert [p["value"] for p in reply["probabilities"]] == [True, False]
    assert all(type(p["value"]) is bool for p in reply["probabilities"])
    assert type(reply["choice"]) is bool, "booleans come back as booleans"
    assert total(reply["probabilities"]) == pytest.approx(1)
    assert decision.usage.input_tokens > 0
    assert decision.usage.output_tokens == 0

    raw = client.post("/systemone", body={"model": "jev", **SYSTEM_ONE}, cast_to=object)
    assert isinstance(raw, dict)
    assert raw["model"] == "jev", "the public id, not the engine's served name"
    answers = raw["answers"]
    assert list(answers) == ["bug", "team", "urgency"], "the caller's ids"
    assert answers["bug"]["type"] == "noul"
    assert 0 < answers["bug"]["noul"] < 1
    assert list(answers["team"]["probabilities"]) == ["mobile", "web"]
    assert sum(answers["team"]["probabilities"].values()) == pytest.approx(1)
    assert answers["urgency"]["legend"] == {"0": "low", "1": "medium", "2": "high"}


def test_models_marks_jev_as_a_decision_model(role: Cluster, jev: Path) -> None:
    listed = {model.id: model.model_dump() for model in role.openai().models.list()}
    assert listed["jev"]["architecture"] == {"output_modalities": ["decisions"]}


def test_the_launch_went_through_readiness_and_its_canary(role: Cluster, jev: Path) -> None:
    role.openai().post("/systemone", body={"model": "jev", **SYSTEM_ONE}, cast_to=object)
    instance = role.instance("jev")
    assert instance is not None
    assert str(instance.state) == "ready"
    assert instance.canary in ("yes", "no")
    assert ("starting", "ready", "ready: health and canary passed") in role.transitions("jev")
    # The engine loads the deployed file, with batch and micro-batch at a slot's context.
    assert instance.process is not None
    (engine,) = processes_mentioning(str(jev))
    assert os.getpgid(engine) == instance.process.pgid, "the instance's own process"
    argv = Path(f"/proc/{engine}/cmdline").read_bytes().decode().split("\0")
    assert argv[argv.index("-m") + 1] == str(jev)
    slot = "256"  # 512 among 4 slots is 128, and llama.cpp gives a slot at least 256
    assert argv[argv.index("-b") + 1] == argv[argv.index("-ub") + 1] == slot, argv


def test_a_plain_gguf_is_refused_at_deploy(role: Cluster, llama: str) -> None:
    model = write_tiny_model(role.root / "plain.gguf")
    document = {
        "name": "plain",
        "engine": llama,
        "model": str(model),
        "api": "decisions",
        "engine_config": {"context_length": CONTEXT, **SMALL},
    }
    path = role.root / "plain.yaml"
    path.write_text(yaml.safe_dump(document))
    refused = role.cli("deploy", "model", "--file", str(path))
    assert refused.returncode == 5, refused.stderr
    assert "error [not_a_decision_model]" in refused.stderr


def test_a_chat_request_to_jev_is_the_wrong_api(role: Cluster, jev: Path) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        role.openai().chat.completions.create(
            model="jev", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert refused.value.code == "wrong_api"
