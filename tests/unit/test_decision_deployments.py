"""Decision deployments (`api: decisions`): the field, the checkpoint check, the engines that
may serve one (by version), the flags a launch bars, LMCache's gate, and the canary."""

from __future__ import annotations

from typing import Any

import pytest

from capycommon.deployments import HostFacts, Resolved, parse_deployment, resolve
from capycommon.deployments.load import revision_digest
from capycommon.deployments.resolve import hub_store
from capycommon.domain.deployment import ModelSource
from capycommon.domain.models import DecisionHead, HostModels, ModelFacts
from capycommon.engines import decisions
from capycommon.engines.adapters import adapter_for
from capycommon.engines.families import Family
from capycommon.errors import CapyError
from support import engine_profile

GiB = 1 << 30
HOST = HostFacts(unified=False, parked_room=32 * GiB, gpus=("gpu0",))
SGLANG = engine_profile(Family.SGLANG, "sg22").model_copy(update={"version": "0.5.22"})
OLD_SGLANG = engine_profile(Family.SGLANG, "sg21").model_copy(update={"version": "0.5.21"})
VLLM = engine_profile(Family.VLLM, "v32").model_copy(update={"version": "0.32.0"})
LLAMA = engine_profile(Family.LLAMACPP, "llama")
CACHE = engine_profile(Family.LMCACHE, "lmcache").model_copy(
    update={"install_path": SGLANG.install_path, "executable": SGLANG.executable}
)
PROFILES = {p.name: p for p in (SGLANG, OLD_SGLANG, VLLM, LLAMA, CACHE)}
ROOT = "/srv/models"
HEADS = {
    "decision_config": DecisionHead(
        kind="decision_config", evidence=f"{ROOT}/m/decision_config.json"
    ),
    "joint_head": DecisionHead(kind="joint_head", evidence=f"{ROOT}/m/joint_head_config.json"),
    "gguf": DecisionHead(kind="gguf", evidence=f"{ROOT}/m: decision.type clef", type="clef"),
}


def models(head: str | None) -> HostModels:
    facts = ModelFacts(
        path=f"{ROOT}/m", kind="folder", weights_bytes=8 * GiB, decision=HEADS.get(head or "")
    )
    return HostModels(models_root=ROOT, models={"m": facts})


def bind(engine: str = "sg22", head: str | None = "decision_config", **fields: Any) -> Resolved:
    fields.setdefault("residency", "restart_only")
    fields.setdefault("api", "decisions")
    if engine == "llama":
        fields.setdefault("engine_config", {"context_length": 4096})
    document = parse_deployment({"name": "m", "engine": engine, "model": "m", **fields}, "t.yaml")
    return resolve(document, profiles=PROFILES, models=models(head), host=HOST)


def refusal(**fields: Any) -> CapyError:
    with pytest.raises(CapyError) as caught:
        bind(**fields)
    return caught.value


def test_api_is_chat_unless_a_document_says_decisions() -> None:
    plain = parse_deployment({"name": "m", "engine": "vllm", "model": "m"}, "t.yaml")
    assert plain.api == "chat"
    assert not plain.decides
    stated = parse_deployment({"name": "m", "engine": "vllm", "model": "m", "api": "chat"}, "t")
    assert revision_digest(stated) == revision_digest(plain), "stating the default is no change"
    decider = parse_deployment({"name": "m", "engine": "x", "model": "m", "api": "decisions"}, "")
    assert decider.decides
    assert revision_digest(decider) != revision_digest(plain)
    with pytest.raises(CapyError, match="api"):
        parse_deployment({"name": "m", "engine": "x", "model": "m", "api": "classify"}, "t")


@pytest.mark.parametrize(
    ("engine", "head"), [("sg22", "decision_config"), ("sg22", "joint_head"), ("llama", "gguf")]
)
def test_a_decision_model_resolves_on_an_engine_that_reads_its_head(engine: str, head: str) -> None:
    assert bind(engine, head).deployment.decides


def test_vllm_is_refused_by_version_with_capability_missing_decisions() -> None:
    found = refusal(engine="v32")
    assert found.code == "capability_missing:decisions"
    assert "vllm 0.32.0 would answer a decision model from its text output" in found.message
    assert not adapter_for(Family.VLLM).capabilities("0.33.0").decisions, "none qualified yet"
    old = refusal(engine="sg21")
    assert old.code == "capability_missing:decisions", "SGLang reads decision heads from 0.5.22"


def test_a_model_that_is_no_decision_model_is_refused_naming_what_it_lacks() -> None:
    folder = refusal(head=None)
    assert folder.code == "not_a_decision_model"
    assert "has no decision_config.json, nor joint_head_config.json" in folder.message
    assert "drop api: decisions" in folder.message
    gguf = refusal(engine="llama", head=None)
    assert gguf.code == "not_a_decision_model"
    assert "GGUF metadata has no <architecture>.decision.type" in gguf.message


def test_a_decision_model_for_the_other_engine_is_refused_naming_which() -> None:
    on_llama = refusal(engine="llama", head="decision_config")
    assert on_llama.code == "not_a_decision_model"
    assert "serve it on SGLang" in on_llama.message
    on_sglang = refusal(engine="sg22", head="gguf")
    assert "serve it on llama.cpp" in on_sglang.message


def test_a_hub_store_not_downloaded_yet_waits_for_hostd_to_check_it() -> None:
    source = ModelSource(hf=f"org/judge@{'a' * 40}")
    document = parse_deployment(
        {"name": "m", "engine": "sg22", "model": source.model_dump(), "api": "decisions"}, "t"
    )
    store = hub_store(source)
    missing = ModelFacts(path=f"{ROOT}/{store}", kind="missing")
    found = resolve(
        document,
        profiles=PROFILES,
        models=HostModels(models_root=ROOT, described={store: missing}),
        host=HOST,
    )
    assert found.model_path.name.startswith("org--judge@")


# The flags a decision launch bars: the engine of each, and what its refusal says.
BARRED = {
    "--chat-template=x.jinja": ("sg22", "the checkpoint's own chat template"),
    "--speculative-algo": ("sg22", "(that is --speculative-algorithm)"),
    "--allow-auto-truncate": ("sg22", "readout positions"),
    "--enable-lmcache": ("sg22", "radix cache is off"),
    "--ubatch-size": ("llama", "sets it to a slot's context"),
}


@pytest.mark.parametrize("arg", BARRED)
def test_flags_a_decision_launch_bars_are_refused(arg: str) -> None:
    engine, said = BARRED[arg]
    found = refusal(
        engine=engine,
        head="gguf" if engine == "llama" else "decision_config",
        engine_config={"extra_args": [arg, "1"]}
        | ({"context_length": 4096} if engine == "llama" else {}),
    )
    assert found.code == "invalid_config"
    assert "is barred for a decision model" in found.message
    assert said in found.message


def test_sglang_runs_a_decision_model_without_lmcache() -> None:
    found = bind(lmcache="auto")
    assert found.cache is None
    assert found.cache_note.endswith("[decisions]")
    required = refusal(lmcache="required")
    assert required.code == "lmcache_unavailable:decisions"


def test_the_canary_is_one_choice_and_its_answer_the_option_chosen() -> None:
    body = decisions.canary_body("judge")
    assert body["model"] == "judge"
    assert list(body["questions"]["canary"]["criteria"]) == ["yes", "no"]
    assert decisions.canary_answer({"answers": {"canary": {"choice": "no"}}}) == "no"
    with pytest.raises(ValueError, match="chose 'maybe'"):
        decisions.canary_answer({"answers": {"canary": {"choice": "maybe"}}})


def test_llamacpp_modalities_are_read_for_the_served_model_or_its_alias() -> None:
    listed = {
        "data": [
            {"id": "other", "architecture": {"output_modalities": ["text"]}},
            {
                "id": "m.gguf",
                "aliases": ["judge"],
                "architecture": {"output_modalities": ["decisions"]},
            },
        ]
    }
    assert decisions.modalities(listed, "judge") == ["decisions"]
    assert decisions.modalities(listed, "other") == ["text"]
    assert decisions.modalities({"data": [{"id": "judge"}]}, "judge") is None
