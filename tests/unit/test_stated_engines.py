"""TensorFold and custom engines: restart-only, sized by what the deployment states
(`resources`), and a custom engine's command checked where it is registered."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from capycommon.deployments import HostFacts, Resolved, parse_deployment
from capycommon.deployments.load import revision_digest
from capycommon.domain.engines import Residency
from capycommon.domain.instances import InstanceState as S
from capycommon.domain.places import Places
from capycommon.engines import detect, tensorfold
from capycommon.engines.adapters import adapter_for
from capycommon.engines.families import Family
from capycommon.engines.launch import LaunchSpec
from capycommon.engines.registry import EngineProfile
from capycommon.errors import CapyError
from capyctl_scheduler.actions import Action
from capyctl_scheduler.launchcommand import launch_command
from capyctl_scheduler.ledger import derive_domains
from capyctl_scheduler.policy import plan
from capyctl_scheduler.routedload import RoutedLoads
from capyctl_scheduler.sizing import engine_footprints
from capyctl_scheduler.snapshot import Binding, HostView, Snapshot
from support import engine_profile
from unit.launches import resolved
from unit.readings import idle_reading
from unit.test_first_starts import HOST, view
from unit.test_policy import deployment, instance

GiB = 1 << 30
STATED: dict[str, Any] = {
    "resources": {"gpu": "6GiB", "ram": "2GiB"},
    "engine_config": {"context_length": 4096},
}
UNIFIED = HostFacts(unified=True, parked_room=32 * GiB, gpus=("gpu0",))


def refusal(family: Family, **document: Any) -> CapyError:
    with pytest.raises(CapyError) as caught:
        resolved(family, 4 * GiB, **document)
    return caught.value


@pytest.mark.parametrize("family", [Family.TENSORFOLD, Family.CUSTOM])
def test_they_run_restart_only_without_lmcache(family: Family) -> None:
    found = resolved(family, 4 * GiB, **STATED)
    assert found.residency == Residency.RESTART_ONLY
    assert found.residency_reason == f"{family} cannot park"
    assert found.cache is None
    refused = refusal(family, residency="deep", **STATED)
    assert refused.code == "capability_missing:deep_park"


@pytest.mark.parametrize("family", [Family.TENSORFOLD, Family.CUSTOM])
def test_they_need_stated_resources(family: Family) -> None:
    refused = refusal(family, engine_config={"context_length": 4096})
    assert refused.code == "invalid_config"
    assert f"resources is required for {family} engines" in refused.message
    assert "resources: {gpu: 20GiB, ram: 4GiB}" in refused.message


def test_tensorfold_needs_a_context_length_and_the_others_take_no_resources() -> None:
    refused = refusal(Family.TENSORFOLD, resources=STATED["resources"])
    assert "engine_config.context_length is required for TensorFold" in refused.message
    refused = refusal(Family.VLLM, resources=STATED["resources"])
    assert "resources is for tensorfold and custom engines" in refused.message


def test_a_custom_engines_extra_arguments_never_repeat_its_commands_options() -> None:
    refused = refusal(Family.CUSTOM, **{**STATED, "engine_config": {"extra_args": ["--port=1"]}})
    assert "--port is reserved: CapyCTL sets it for custom" in refused.message
    passed = resolved(Family.CUSTOM, GiB, **{**STATED, "engine_config": {"extra_args": ["--x"]}})
    assert passed.extra_args == ("--x",)


@pytest.mark.parametrize(
    "name",
    ["TENSORFOLD_CUDA_MEMORY_LIMIT_GB", "TENSORFOLD_NO_UPDATE_CHECK", "TENSORFOLD_API_KEY"],
)
def test_the_variables_capyctl_sets_for_tensorfold_are_reserved(name: str) -> None:
    document = {"name": "m", "engine": "tensorfold", "model": "m"}
    with pytest.raises(CapyError) as caught:
        parse_deployment({**document, "engine_config": {"env": {name: "1"}}}, "test")
    assert caught.value.code == f"engine_env_reserved:{name}"


def test_what_is_stated_is_charged_while_it_runs_and_nothing_otherwise() -> None:
    found = resolved(Family.TENSORFOLD, 4 * GiB, **STATED)
    footprint = engine_footprints(found, view(24 * GiB))["gpu0"]
    for phase in ("starting", "ready", "waking"):
        assert footprint.charge(phase) == {"gpu0": 6 * GiB, "system": 2 * GiB}
    assert footprint.charge("cold") == {}
    assert footprint.charge("parked") == {}
    assert (footprint.device_provenance, footprint.host_provenance) == ("declared", "declared")
    pooled = resolved(Family.CUSTOM, 4 * GiB, host=UNIFIED, **STATED)
    unified = view_unified()
    assert engine_footprints(pooled, unified)["gpu0"].charge("ready") == {"unified": 8 * GiB}


def view_unified() -> HostView:
    reading = idle_reading((128 * GiB, True), ram=128 * GiB)
    return HostView(HOST, {d.name: d for d in derive_domains(reading)}, {"gpu0": "GPU-0"}, True)


def start_of(found: Resolved) -> tuple[Snapshot, Action]:
    host = view(24 * GiB)
    name = found.deployment.name
    bindings = {name: {HOST: Binding(HOST, found, engine_footprints(found, host))}}
    record = deployment(name, engine=found.profile.family.value)
    record = record.model_copy(update={"document": found.deployment})
    snapshot = Snapshot(
        now=100.0,
        deployments={name: record},
        instances={},
        hosts={HOST: host},
        bindings=bindings,
        demands={name: 99.0},
    )
    (start,) = [action for action in plan(snapshot) if action.kind == "start"]
    return snapshot, start


def test_tensorfold_is_told_what_its_deployment_states_and_vllm_is_not() -> None:
    snapshot, start = start_of(resolved(Family.TENSORFOLD, 4 * GiB, name="tf", **STATED))
    launch = launch_command(snapshot, snapshot.deployments["tf"], start)
    assert launch.gpu_memory_bytes == 6 * GiB
    snapshot, start = start_of(resolved(Family.VLLM, 4 * GiB, name="v"))
    assert launch_command(snapshot, snapshot.deployments["v"], start).gpu_memory_bytes is None


def test_the_memory_limit_is_rounded_down_to_a_hundredth_of_a_gib() -> None:
    assert tensorfold.memory_limit(6 * GiB) == "6.00"
    assert tensorfold.memory_limit(6 * GiB - 1) == "5.99"
    assert tensorfold.memory_limit(GiB // 3) == "0.33"


@pytest.fixture
def program(tmp_path: Path) -> Path:
    found = tmp_path / "bin" / "serve"
    found.parent.mkdir()
    found.write_text("#!/bin/sh\nexit 0\n")
    found.chmod(0o755)
    return found


def test_a_custom_registration_keeps_its_command_word_for_word(program: Path) -> None:
    command = (
        f"{program} --model {{model}} --port {{port}} --name '{{served_name}} x' --j '{{{{}}}}'"
    )
    found = detect.custom_profile("tgi", command, "/v1/models", "TGI_KEY", "3.3.4")
    assert found.command == (
        str(program),
        "--model",
        "{model}",
        "--port",
        "{port}",
        "--name",
        "{served_name} x",
        "--j",
        "{{}}",
    )
    assert (found.family, found.executable, found.version) == (Family.CUSTOM, program, "3.3.4")
    assert found.fingerprint.startswith("3.3.4+sha256:")
    again = detect.custom_profile("tgi", command.replace("--j", "--k"), "/h", None, "3.3.4")
    assert again.fingerprint != found.fingerprint, "the command is part of what it runs"


@pytest.mark.parametrize(
    ("command", "ready", "key", "says"),
    [
        ("{program} --port {{port}}", "/health", None, "never names {model}"),
        ("{program} {{port}} {{model}} {{key}}", "/health", None, "names {key}, which is not"),
        ("{program} {{port}} {{model}} {{", "/health", None, "write a literal brace"),
        ("serve {{port}} {{model}}", "/health", None, "is not an executable file"),
        ("{program} {{port}} {{model}}", "health", None, "ready_path: String should match"),
        ("{program} {{port}} {{model}}", "/health", "PATH", "key_env PATH is a variable CapyCTL"),
        ("{program} {{port}} {{model}}", "/health", "CAPYCTL_X", "is a variable CapyCTL sets"),
        ("{program} '{{port}} {{model}}", "/health", None, "No closing quotation"),
        ("{program} {{port}} {{model}}", "/v1/{port}", None, "may name {served_name} alone"),
    ],
)
def test_a_custom_registration_that_cannot_start_safely_is_refused(
    program: Path, command: str, ready: str, key: str | None, says: str
) -> None:
    with pytest.raises(CapyError) as caught:
        detect.custom_profile("tgi", command.format(program=program), ready, key, "1")
    assert says in caught.value.message
    assert caught.value.code in ("invalid_config", "engine_not_found")


def test_a_readiness_path_may_wait_for_the_served_model(program: Path) -> None:
    """Ollama answers /v1/models/<name> with 404 until that model exists."""
    command = f"{program} {{port}} {{model}} {{served_name}}"
    found = detect.custom_profile("ol", command, "/v1/models/{served_name}", None, "0.13")
    spec = LaunchSpec(
        profile=found,
        model_path=program,
        served_name="qwen3:4b",
        port=9000,
        api_key="k",
        residency=Residency.RESTART_ONLY,
        runtime_dir=program.parent,
    )
    control = adapter_for(Family.CUSTOM).control(spec)
    assert control.ready_path() == "/v1/models/qwen3%3A4b"


def test_a_published_profile_with_a_command_it_should_not_carry_is_refused() -> None:
    """What a host publishes is checked as it is read: a vLLM profile with a command, or a
    custom one whose command is not its executable, is no profile."""
    vllm = engine_profile(Family.VLLM).model_dump(mode="json")
    with pytest.raises(ValidationError, match="for custom engines only"):
        EngineProfile.model_validate({**vllm, "command": ["/bin/sh", "{port}", "{model}"]})
    custom = engine_profile(Family.CUSTOM).model_dump(mode="json")
    with pytest.raises(ValidationError, match="must be an absolute path, the profile's"):
        EngineProfile.model_validate({**custom, "command": ["/bin/sh", "{port}", "{model}"]})
    assert os.path.isabs(custom["executable"])


def test_the_load_of_an_unmetered_engine_is_the_routers_places() -> None:
    """No reading comes from TensorFold or a custom engine: its load is made from the places,
    and its last request is the last snapshot that saw one (or a spare, kept a second after)."""
    tf = resolved(Family.TENSORFOLD, 4 * GiB, name="tf", **STATED)
    bindings = {
        "tf": {HOST: Binding(HOST, tf)},
        "v": {HOST: Binding(HOST, resolved(Family.VLLM, GiB, name="v"))},
    }
    ready = {
        "tf": instance("tf", S.READY, generation=2, since=10.0),
        "v": instance("v", S.READY, since=10.0),
    }
    routed = RoutedLoads()
    busy = routed.loads(20.0, ready, {"tf": Places(generation=2, running=1)}, bindings)
    assert list(busy) == ["tf"], "vLLM's load is read from its metrics"
    assert (busy["tf"].running, busy["tf"].busy, busy["tf"].last_active_at) == (1, True, 20.0)
    spare = routed.loads(25.0, ready, {"tf": Places(generation=2, spare=1)}, bindings)
    assert (spare["tf"].busy, spare["tf"].last_active_at) == (False, 25.0)
    idle = routed.loads(60.0, ready, {"tf": Places(generation=2)}, bindings)
    assert (idle["tf"].busy, idle["tf"].last_active_at, idle["tf"].read_at) == (False, 25.0, 60.0)
    stale = routed.loads(61.0, ready, {"tf": Places(generation=1, running=3)}, bindings)
    assert stale["tf"].running == 0, "another generation's places are not this engine's"
    restarted = {**ready, "tf": instance("tf", S.READY, generation=3, since=70.0)}
    assert routed.loads(80.0, restarted, {}, bindings)["tf"].last_active_at == 70.0
    assert routed.loads(81.0, {**ready, "tf": instance("tf", S.STOPPED)}, {}, bindings) == {}


def test_a_document_without_resources_keeps_the_digest_it_had() -> None:
    """Declared deployments keep their revision across the upgrade that added `resources`:
    this digest is what the release before it gave the same document."""
    document = {"name": "qwen3-4b", "engine": "vllm", "model": "Qwen3-4B"}
    plain = parse_deployment({**document, "engine_config": {"context_length": 8192}}, "t")
    assert revision_digest(plain) == (
        "sha256:b2afa7186d143da6cc9e64c9f1c418a9a114c6dfb149f53a5efc78ee355e21ab"
    )
    stated = parse_deployment({**document, "resources": STATED["resources"]}, "t")
    assert revision_digest(stated) != revision_digest(parse_deployment(document, "t"))
