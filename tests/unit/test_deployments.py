"""Deployment documents: strict parsing, revisions, routes, and binding to a host."""

from __future__ import annotations

import textwrap
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from capycommon.deployments import (
    Deployment,
    HostFacts,
    ModelNotDescribed,
    Resolved,
    check_routes,
    env_reserved,
    load_deployment,
    parse_deployment,
    resolve,
    revision_digest,
)
from capycommon.deployments.resolve import hub_origin, hub_store
from capycommon.domain.deployment import ModelSource
from capycommon.domain.engines import Residency
from capycommon.domain.models import HostModels, ModelFacts
from capycommon.engines.families import ENGINE_FAMILIES, Family
from capycommon.engines.registry import EngineProfile
from capycommon.errors import CapyError, InvalidConfig
from capycommon.units import format_duration, format_size_exact, parse_duration, parse_size
from support import engine_profile

GiB = 1 << 30
MINIMAL = {"name": "qwen3-4b", "engine": "vllm", "model": "Qwen3-4B"}
DISCRETE = HostFacts(unified=False, parked_room=32 * GiB, gpus=("gpu0", "gpu1"))
UNIFIED = HostFacts(unified=True, parked_room=32 * GiB, gpus=("gpu0",))
FULL = """\
name: qwen3-8b
engine: vllm
model: /srv/models/Qwen3-8B
routes: [qwen3-8b, Qwen/Qwen3-8B]
residency: deep
devices: [{id: gpu1}]
engine_config:
  context_length: 32768
  max_concurrent_requests: 16
  memory: {request: 40GiB, kv_cache: 12GiB, startup: 48GiB}
  tool_call_parser: hermes
  reasoning_parser: qwen3
  extra_args: [--max-num-batched-tokens, "8192"]
  env: {VLLM_LOGGING_LEVEL: DEBUG, PYTHONUNBUFFERED: "1"}
lifecycle:
  ready_idle_timeout: 5m
  parked_idle_timeout: 1h
  warm: true
  activation: explicit
request_deadline: 900s
"""


def write(tmp_path: Path, text: str, name: str = "deployment.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def parse(**changes: Any) -> Deployment:
    return parse_deployment({**MINIMAL, **changes}, "test.yaml")


def refusal(**changes: Any) -> CapyError:
    with pytest.raises(CapyError) as caught:
        parse(**changes)
    return caught.value


PROFILES = {family.value: engine_profile(family) for family in ENGINE_FAMILIES}


# --- the document ---------------------------------------------------------------------------


def test_the_minimal_document_is_name_engine_and_model(tmp_path: Path) -> None:
    path = write(tmp_path, "name: qwen3-4b\nengine: vllm\nmodel: Qwen3-4B\n")
    deployment = load_deployment(path)
    assert deployment.name == "qwen3-4b"
    assert deployment.engine == "vllm"
    assert deployment.model.path == "Qwen3-4B"
    assert deployment.routes == ("qwen3-4b",)
    assert deployment.residency is None
    assert deployment.pinned == ()
    assert deployment.gpu_count == 1
    assert deployment.lifecycle.activation == "on_demand"
    assert deployment.lifecycle.warm is False
    assert deployment.engine_config.memory.request is None
    assert deployment.request_deadline is None


def test_a_full_document_reads_sizes_as_bytes_and_durations_as_seconds(tmp_path: Path) -> None:
    deployment = load_deployment(write(tmp_path, FULL))
    config = deployment.engine_config
    assert config.memory.request == 40 * GiB
    assert config.memory.kv_cache == 12 * GiB
    assert config.memory.startup == 48 * GiB
    assert config.context_length == 32768
    assert config.extra_args == ("--max-num-batched-tokens", "8192")
    assert config.env == {"VLLM_LOGGING_LEVEL": "DEBUG", "PYTHONUNBUFFERED": "1"}
    assert deployment.lifecycle.ready_idle_timeout == 300.0
    assert deployment.lifecycle.parked_idle_timeout == 3600.0
    assert deployment.lifecycle.activation == "explicit"
    assert deployment.request_deadline == 900.0
    assert deployment.residency == Residency.DEEP
    assert deployment.pinned == ("gpu1",)
    assert deployment.routes == ("qwen3-8b", "Qwen/Qwen3-8B")


def test_a_dumped_document_reads_back_the_same(tmp_path: Path) -> None:
    deployment = load_deployment(write(tmp_path, FULL))
    dumped = deployment.model_dump(mode="json")
    assert dumped["engine_config"]["memory"]["request"] == "40GiB"
    assert dumped["lifecycle"]["ready_idle_timeout"] == "5m"
    assert dumped["request_deadline"] == "15m"
    assert parse_deployment(dumped, "dump") == deployment


@pytest.mark.parametrize(
    ("model", "path", "hf", "repo", "commit"),
    [
        ("Qwen3-4B", "Qwen3-4B", None, None, None),
        ({"path": "/srv/m"}, "/srv/m", None, None, None),
        ({"hf": "Qwen/Qwen3-4B"}, None, "Qwen/Qwen3-4B", "Qwen/Qwen3-4B", None),
        (
            {"hf": "Qwen/Qwen3-4B@" + "a" * 40},
            None,
            "Qwen/Qwen3-4B@" + "a" * 40,
            "Qwen/Qwen3-4B",
            "a" * 40,
        ),
    ],
)
def test_a_model_is_a_path_or_a_hugging_face_repository(
    model: object, path: str | None, hf: str | None, repo: str | None, commit: str | None
) -> None:
    source = parse(model=model).model
    assert (source.path, source.hf, source.hf_repo, source.hf_commit) == (path, hf, repo, commit)


# --- refusals while reading -----------------------------------------------------------------


def test_an_unknown_key_is_refused_naming_it(tmp_path: Path) -> None:
    path = write(
        tmp_path, "name: a\nengine: vllm\nmodel: m\nengine_config:\n  memory:\n    kv: 1GiB\n"
    )
    with pytest.raises(InvalidConfig) as caught:
        load_deployment(path)
    assert caught.value.code == "invalid_config"
    assert caught.value.exit_code == 2
    assert str(path) in caught.value.message
    assert "unknown key 'engine_config.memory.kv'" in caught.value.message


@pytest.mark.parametrize(
    ("key", "value", "pointer"),
    [
        ("env", {"A": "1"}, "engine_config.env"),
        ("context_length", 8192, "engine_config.context_length"),
        ("warm", True, "lifecycle.warm"),
        ("runtime_profile", "vllm", "engine"),
    ],
)
def test_a_key_in_the_wrong_place_is_refused_with_its_place(
    key: str, value: object, pointer: str
) -> None:
    error = refusal(**{key: value})
    assert f"unknown key {key!r}; it belongs at {pointer}" in error.message


def test_a_key_this_release_lacks_is_refused_as_such() -> None:
    assert "does not support it yet" in refusal(instances=2).message


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("name: a\nengine: vllm\nmodel: m\nname: b\n", "duplicate key 'name' at line 4"),
        (
            "name: a\nengine: vllm\nmodel: m\nlifecycle:\n  warm: true\n  warm: false\n",
            "duplicate key 'warm' at line 6",
        ),
    ],
)
def test_a_duplicate_key_is_refused_naming_it_and_its_line(
    tmp_path: Path, text: str, says: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(InvalidConfig) as caught:
        load_deployment(path)
    assert caught.value.code == "invalid_config"
    assert caught.value.message.startswith(f"{path}: {says}; keep one of them")


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just text\n"])
def test_a_document_that_is_not_a_mapping_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(InvalidConfig, match="a deployment is a mapping"):
        load_deployment(write(tmp_path, text))


def test_a_missing_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match=r"cannot read .*nope\.yaml"):
        load_deployment(tmp_path / "nope.yaml")


def test_the_required_keys_are_named() -> None:
    with pytest.raises(InvalidConfig) as caught:
        parse_deployment({"name": "a"}, "test.yaml")
    assert "engine is required" in caught.value.message
    assert "model is required" in caught.value.message


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        ({"name": "My Model"}, "name", "not a deployment name"),
        ({"name": "a:b"}, "name", "not a deployment name"),
        ({"engine": "VLLM!"}, "engine", "not an engine name"),
        ({"model": 3}, "model", "name a folder under the models root"),
        ({"model": ""}, "model", "path is empty"),
        ({"model": "../elsewhere"}, "model", "climbs out"),
        ({"model": {"hf": "Qwen3-4B"}}, "model.hf", "org/name"),
        ({"model": {"hf": "Qwen/Qwen3-4B@abc"}}, "model.hf", "40-hex commit"),
        ({"model": {"hf": "a/b", "path": "c"}}, "model", "exactly one of path or hf"),
        ({"model": {"repo": "a/b"}}, "model.repo", "unknown key"),
        ({"routes": []}, "routes", "list at least one"),
        ({"routes": ["a", "b", "a"]}, "routes", "a listed twice"),
        ({"routes": ["has space"]}, "routes[0]", "not a route"),
        ({"residency": "auto"}, "residency", "'host_backed', 'deep' or 'restart_only'"),
        ({"devices": [{"id": "cuda:0"}]}, "devices[0].id", "write gpuN"),
        (
            {"devices": [{"id": "gpu0", "sharing": "exclusive"}]},
            "devices[0].sharing",
            "unknown key",
        ),
        (
            {"engine_config": {"context_length": "8k"}},
            "engine_config.context_length",
            "valid integer",
        ),
        (
            {"engine_config": {"context_length": 0}},
            "engine_config.context_length",
            "greater than or equal to 1",
        ),
        (
            {"engine_config": {"max_concurrent_requests": True}},
            "engine_config.max_concurrent_requests",
            "valid integer",
        ),
        (
            {"engine_config": {"tool_call_parser": "her mes"}},
            "engine_config.tool_call_parser",
            "not a parser name",
        ),
        (
            {"engine_config": {"extra_args": ["--max-num-batched-tokens", 8192]}},
            "engine_config.extra_args[1]",
            "quote it",
        ),
        (
            {"engine_config": {"env": {"NCCL DEBUG": "1"}}},
            "engine_config.env.NCCL DEBUG",
            "not a variable name",
        ),
        (
            {"engine_config": {"env": {"VLLM_LOGGING_LEVEL": 10}}},
            "engine_config.env.VLLM_LOGGING_LEVEL",
            "quote it",
        ),
        ({"lifecycle": {"warm": "yes"}}, "lifecycle.warm", "valid boolean"),
        (
            {"lifecycle": {"activation": "lazy"}},
            "lifecycle.activation",
            "'on_demand' or 'explicit'",
        ),
        ({"request_deadline": "2h"}, "request_deadline", "the most a request may wait, 1h"),
        ({"kind": "host"}, "kind", "'deployment'"),
    ],
)
def test_a_bad_value_is_refused_naming_the_field(
    changes: dict[str, Any], field: str, says: str
) -> None:
    error = refusal(**changes)
    assert isinstance(error, InvalidConfig)
    assert error.code == "invalid_config"
    assert error.exit_code == 2
    assert error.message.startswith("test.yaml: ")
    assert field in error.message
    assert says in error.message


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("request", "14GB", "B, KiB, MiB, GiB, TiB"),
        ("request", "fourteen", "B, KiB, MiB, GiB, TiB"),
        ("kv_cache", 4096, "B, KiB, MiB, GiB, TiB"),
        ("startup", "0GiB", "above zero"),
    ],
)
def test_a_size_with_a_bad_unit_is_refused_naming_the_units(
    field: str, value: object, says: str
) -> None:
    error = refusal(engine_config={"memory": {field: value}})
    assert f"engine_config.memory.{field}: {value!r} is " in error.message
    assert says in error.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ready_idle_timeout", "5 minutes"),
        ("parked_idle_timeout", 300),
        ("ready_idle_timeout", "0s"),
        ("parked_idle_timeout", "1d"),
    ],
)
def test_a_duration_with_a_bad_unit_is_refused_naming_the_units(field: str, value: object) -> None:
    error = refusal(lifecycle={field: value})
    assert f"lifecycle.{field}: {value!r} is " in error.message
    assert "500ms, 30s, 5m or 1h" in error.message or "above zero" in error.message


def test_the_startup_peak_is_at_least_the_request() -> None:
    error = refusal(engine_config={"memory": {"request": "14GiB", "startup": "10GiB"}})
    assert "engine_config.memory: startup (10GiB) is below request (14GiB)" in error.message
    fits = parse(engine_config={"memory": {"request": "14GiB", "startup": "14GiB"}})
    assert fits.engine_config.memory.startup == 14 * GiB


def test_the_kv_cache_fits_in_the_request() -> None:
    error = refusal(engine_config={"memory": {"request": "8GiB", "kv_cache": "12GiB"}})
    assert "kv_cache (12GiB) is above request (8GiB)" in error.message


def test_every_problem_is_named_in_one_message() -> None:
    error = refusal(
        name="Bad Name",
        colour="red",
        engine_config={"memory": {"request": "1GB"}},
        lifecycle={"activation": "lazy"},
    )
    for field in ("name", "colour", "engine_config.memory.request", "lifecycle.activation"):
        assert field in error.message
    assert error.message.count("; ") >= 3


@pytest.mark.parametrize(
    "name",
    [
        "PATH",
        "HOME",
        "NCCL_DEBUG",
        "GLOO_SOCKET_IFNAME",
        "MASTER_ADDR",
        "CAPYCTL_API_KEY",
        "LD_PRELOAD",
        "PYTHONPATH",
        "PYTHONHOME",
        "CUDA_VISIBLE_DEVICES",
        "VLLM_API_KEY",
        "VLLM_SERVER_DEV_MODE",
        "HF_HUB_OFFLINE",
        "LLAMA_API_KEY",
        "DO_NOT_TRACK",
        "VLLM_NO_USAGE_STATS",
        "VLLM_DO_NOT_TRACK",
        "VLLM_PORT",
    ],
)
def test_a_reserved_engine_variable_is_refused_by_name(name: str) -> None:
    error = refusal(engine_config={"env": {"VLLM_LOGGING_LEVEL": "DEBUG", name: "x"}})
    assert isinstance(error, InvalidConfig)
    assert error.code == f"engine_env_reserved:{name}"
    assert error.exit_code == 2
    assert f"engine_config.env.{name}: {name} is reserved" in error.message


def test_ordinary_engine_variables_pass() -> None:
    env = {"PYTHONUNBUFFERED": "1", "HF_TOKEN": "t", "VLLM_LOGGING_LEVEL": "DEBUG", "MAX_JOBS": "4"}
    assert parse(engine_config={"env": env}).engine_config.env == env
    assert not any(env_reserved(name) for name in env)


def test_a_gpu_pinned_twice_is_refused() -> None:
    error = refusal(devices=[{"id": "gpu0"}, {"id": "gpu0"}])
    assert error.code == "invalid_config"
    assert "gpu0 listed twice; keep one" in error.message


def test_the_first_problem_sets_the_code() -> None:
    error = refusal(engine_config={"env": {"PATH": "/x"}}, devices=[{"id": "gpu0"}, {"id": "gpu0"}])
    assert error.code == "invalid_config"  # devices comes before engine_config
    assert "engine_config.env.PATH" in error.message


# --- units ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds", "written"),
    [
        ("500ms", 0.5, "500ms"),
        ("30s", 30.0, "30s"),
        ("5m", 300.0, "5m"),
        ("1h", 3600.0, "1h"),
        ("90s", 90.0, "90s"),
        ("1.5h", 5400.0, "90m"),
        ("0.25s", 0.25, "250ms"),
        (" 2 m ", 120.0, "2m"),
    ],
)
def test_durations_read_and_write_in_their_exact_unit(
    text: str, seconds: float, written: str
) -> None:
    assert parse_duration(text) == seconds
    assert format_duration(seconds) == written


@pytest.mark.parametrize("text", ["5", "5 min", "1d", "-1s", "s", "1e3ms"])
def test_a_bad_duration_names_the_accepted_units(text: str) -> None:
    with pytest.raises(ValueError, match="500ms, 30s, 5m or 1h"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "written"),
    [
        ("14GiB", "14GiB"),
        ("14336MiB", "14GiB"),
        ("1.5GiB", "1536MiB"),
        ("1TiB", "1TiB"),
        ("100B", "100B"),
        ("2048KiB", "2MiB"),
    ],
)
def test_sizes_write_back_in_their_exact_unit(text: str, written: str) -> None:
    assert format_size_exact(parse_size(text)) == written
    assert parse_size(written) == parse_size(text)


# --- revisions ------------------------------------------------------------------------------


def test_layout_key_order_and_equal_spellings_are_the_same_revision(tmp_path: Path) -> None:
    first = write(tmp_path, FULL, "first.yaml")
    shuffled = write(
        tmp_path,
        """\
        # the same deployment, written differently
        request_deadline: 15m
        lifecycle: {activation: explicit, warm: true, parked_idle_timeout: 60m,
                    ready_idle_timeout: 300s}
        engine_config:
          env: {PYTHONUNBUFFERED: "1", VLLM_LOGGING_LEVEL: DEBUG}
          extra_args: ["--max-num-batched-tokens", "8192"]
          reasoning_parser: qwen3
          tool_call_parser: hermes
          memory: {startup: 48GiB, kv_cache: 12288MiB, request: 40GiB}
          max_concurrent_requests: 16
          context_length: 32768
        devices:
          - id: gpu1
        residency: deep
        routes:
          - qwen3-8b
          - Qwen/Qwen3-8B
        model: {path: /srv/models/Qwen3-8B}
        engine: vllm
        kind: deployment
        name: qwen3-8b
        """,
        "shuffled.yaml",
    )
    digest = revision_digest(load_deployment(first))
    assert digest.startswith("sha256:")
    assert len(digest) == len("sha256:") + 64
    assert revision_digest(load_deployment(shuffled)) == digest


def test_stating_a_default_is_the_same_revision() -> None:
    stated = parse(routes=["qwen3-4b"], lifecycle={"warm": False, "activation": "on_demand"})
    assert revision_digest(stated) == revision_digest(parse())


@pytest.mark.parametrize(
    "changes",
    [
        {"model": "Qwen3-8B"},
        {"routes": ["qwen3-4b", "small"]},
        {"residency": "deep"},
        {"engine_config": {"memory": {"request": "15GiB"}}},
        {"engine_config": {"env": {"VLLM_LOGGING_LEVEL": "INFO"}}},
        {"lifecycle": {"ready_idle_timeout": "10m"}},
        {"request_deadline": "10m"},
    ],
)
def test_a_changed_document_is_a_new_revision(changes: dict[str, Any]) -> None:
    assert revision_digest(parse(**changes)) != revision_digest(parse())


# --- routes ---------------------------------------------------------------------------------


def test_disjoint_routes_pass() -> None:
    check_routes([parse(), parse(name="other", routes=["other", "big"])])


def test_a_route_served_twice_is_refused_naming_both_deployments() -> None:
    first = parse(routes=["qwen3-4b", "default"])
    second = parse(name="llama", model="Llama-3", routes=["llama", "default"])
    with pytest.raises(CapyError) as caught:
        check_routes([first, second])
    assert caught.value.code == "route_conflict"
    assert caught.value.exit_code == 2
    assert caught.value.http_status == 409
    message = caught.value.message
    assert "route 'default' of deployment 'llama' is already served by deployment 'qwen3-4b'" in (
        message
    )


def test_a_route_that_is_another_deployments_name_conflicts() -> None:
    with pytest.raises(CapyError, match="route 'qwen3-4b' of deployment 'alias'"):
        check_routes([parse(), parse(name="alias", routes=["qwen3-4b"])])


def test_two_deployments_of_one_name_are_refused() -> None:
    with pytest.raises(InvalidConfig, match="two deployments are named 'qwen3-4b'"):
        check_routes([parse(), parse(model="Other")])


# --- binding to a host: engine --------------------------------------------------------------
#
# A host's models come as the facts its hostd published (tests/integration/hostd/test_model_facts.py
# checks how it reads them off a disk); binding reads nothing else.

ROOT = "/srv/models"


def folder(path: str, weights_size: int | None = 8 * GiB) -> ModelFacts:
    return ModelFacts(path=path, kind="folder", weights_bytes=weights_size)


QWEN = folder(f"{ROOT}/Qwen3-4B")
MODELS = HostModels(models_root=ROOT, models={"Qwen3-4B": QWEN})


def bind(host: HostFacts = DISCRETE, models: HostModels = MODELS, **changes: Any) -> Resolved:
    return resolve(parse(**changes), profiles=PROFILES, models=models, host=host)


def test_an_engine_is_a_registered_profile_by_name() -> None:
    profiles = {"vllm-nightly": engine_profile(Family.VLLM, "vllm-nightly"), **PROFILES}
    resolved = resolve(
        parse(engine="vllm-nightly"), profiles=profiles, models=MODELS, host=DISCRETE
    )
    assert resolved.profile.name == "vllm-nightly"


def test_a_family_names_the_hosts_one_profile_of_it() -> None:
    profiles = {"sg": engine_profile(Family.SGLANG, "sg")}
    resolved = resolve(parse(engine="sglang"), profiles=profiles, models=MODELS, host=UNIFIED)
    assert resolved.profile.name == "sg"


@pytest.mark.parametrize(
    ("engine", "profiles", "says"),
    [
        ("vllm", {"sg": engine_profile(Family.SGLANG, "sg")}, "no vllm engine is registered"),
        (
            "vllm",
            {"a": engine_profile(Family.VLLM, "a"), "b": engine_profile(Family.VLLM, "b")},
            "several registered engines (a, b); name one of them",
        ),
        (
            "mystery",
            {"sg": engine_profile(Family.SGLANG, "sg")},
            "'mystery' is not a registered engine (registered: sg)",
        ),
        ("mystery", {}, "(registered: none)"),
    ],
)
def test_an_engine_the_host_lacks_is_refused_naming_the_registered_ones(
    engine: str, profiles: dict[str, EngineProfile], says: str
) -> None:
    with pytest.raises(CapyError) as caught:
        resolve(parse(engine=engine), profiles=profiles, models=MODELS, host=DISCRETE)
    assert caught.value.code == "profile_not_published"
    assert caught.value.exit_code == 24
    assert caught.value.message.startswith("deployment 'qwen3-4b': engine: ")
    assert says in caught.value.message


# --- binding to a host: the model -----------------------------------------------------------


def test_a_bare_model_name_is_a_model_under_the_models_root() -> None:
    resolved = bind()
    assert resolved.model_path == PurePosixPath(f"{ROOT}/Qwen3-4B")
    assert resolved.weights_bytes == 8 * GiB


@pytest.mark.parametrize("written", ["Qwen3-4B/", "./Qwen3-4B", "Qwen3-4B//"])
def test_a_name_under_the_root_is_found_however_it_is_spelled(written: str) -> None:
    assert bind(model=written).model_path == PurePosixPath(f"{ROOT}/Qwen3-4B")


def test_an_absolute_model_path_is_what_the_host_described() -> None:
    elsewhere = folder("/data/m", GiB)
    models = MODELS.model_copy(update={"described": {"/data/m": elsewhere}})
    resolved = bind(models=models, model="/data/m")
    assert (resolved.model_path, resolved.weights_bytes) == (PurePosixPath("/data/m"), GiB)


@pytest.mark.parametrize("written", ["/data/m", "~/m", "Other", "org/name/deeper"])
def test_a_path_the_host_has_not_described_waits_for_it(written: str) -> None:
    with pytest.raises(ModelNotDescribed) as caught:
        bind(model=written)
    assert caught.value.path == written


def test_an_engine_refusal_comes_before_waiting_for_the_model() -> None:
    with pytest.raises(CapyError, match="not a registered engine"):
        bind(engine="mystery", model="/data/m")


def test_a_missing_model_folder_is_not_found_naming_the_path() -> None:
    missing = ModelFacts(path=f"{ROOT}/Missing", kind="missing")
    models = MODELS.model_copy(update={"described": {"Missing": missing}})
    with pytest.raises(CapyError) as caught:
        bind(models=models, model="Missing")
    assert caught.value.code == "not_found"
    assert caught.value.exit_code == 2
    assert caught.value.message == (
        f"deployment 'qwen3-4b': model: {ROOT}/Missing does not exist; put the model there or "
        "fix model"
    )


def test_a_missing_org_slash_name_suggests_hugging_face() -> None:
    missing = ModelFacts(path=f"{ROOT}/Qwen/Qwen3-8B", kind="missing")
    models = MODELS.model_copy(update={"described": {"Qwen/Qwen3-8B": missing}})
    with pytest.raises(CapyError, match=r"written \{hf: Qwen/Qwen3-8B\}"):
        bind(models=models, model="Qwen/Qwen3-8B")


def test_a_home_folder_the_host_lacks_is_refused() -> None:
    nowhere = ModelFacts(path="~nosuchuser/m", kind="no_home")
    models = MODELS.model_copy(update={"described": {"~nosuchuser/m": nowhere}})
    with pytest.raises(InvalidConfig) as caught:
        bind(models=models, model="~nosuchuser/m")
    assert "model: '~nosuchuser/m' names a home folder that does not exist; write the path" in (
        caught.value.message
    )


@pytest.mark.parametrize(
    "model", [{"hf": "Qwen/Qwen3-4B"}, {"hf": "Qwen/Qwen3-4B", "revision": "v1"}]
)
def test_an_unpinned_hugging_face_model_is_refused(model: dict[str, str]) -> None:
    with pytest.raises(CapyError) as caught:
        bind(model=model)
    assert caught.value.code == "model_source_pending"
    assert caught.value.exit_code == 5
    assert "is not pinned to a commit; deploy it with capyctl deploy model" in caught.value.message


def test_a_pinned_hugging_face_model_resolves_to_its_store_downloaded_or_not() -> None:
    commit = "ab" * 20
    store = f"sources/huggingface/Qwen--Qwen3-4B@{commit}"
    with pytest.raises(ModelNotDescribed) as waiting:
        bind(model={"hf": f"Qwen/Qwen3-4B@{commit}"})
    assert waiting.value.path == store
    missing = ModelFacts(path=f"{ROOT}/{store}", kind="missing")
    models = MODELS.model_copy(update={"described": {store: missing}})
    resolved = bind(models=models, model={"hf": f"Qwen/Qwen3-4B@{commit}"})
    assert (resolved.model_path, resolved.weights_bytes) == (PurePosixPath(missing.path), None)
    there = ModelFacts(path=f"{ROOT}/{store}", kind="folder", weights_bytes=8 * GiB)
    models = MODELS.model_copy(update={"described": {store: there}})
    resolved = bind(models=models, model={"hf": f"Qwen/Qwen3-4B@{commit}"})
    assert resolved.weights_bytes == 8 * GiB


def test_a_stores_path_names_its_repository_and_commit_with_files_chosen_or_not() -> None:
    commit = "ab" * 20
    whole = ModelSource(hf=f"Qwen/Qwen3-4B@{commit}")
    some = ModelSource(hf=f"Qwen/Qwen3-4B@{commit}", files=("*.gguf",))
    assert hub_store(whole) == f"sources/huggingface/Qwen--Qwen3-4B@{commit}"
    assert hub_store(some).startswith(f"{hub_store(whole)}-")
    for source in (whole, some):
        assert hub_origin(hub_store(source)) == ("Qwen/Qwen3-4B", commit)
    assert hub_origin("qwen3-4b") == (None, None)


def test_retention_is_default_or_zero_and_none_leaves_it_to_the_host() -> None:
    assert parse().retention is None
    assert parse(retention="zero").retention == "zero"
    with pytest.raises(InvalidConfig) as caught:
        parse(retention="none")
    assert "retention" in caught.value.message
    assert "'default' or 'zero'" in caught.value.message


def test_revision_and_files_are_for_hugging_face_sources() -> None:
    with pytest.raises(InvalidConfig) as caught:
        parse(model={"path": "m", "revision": "main"})
    assert "revision and files are for hf sources" in caught.value.message


def test_a_single_weights_file_is_a_model() -> None:
    one = ModelFacts(path=f"{ROOT}/one.gguf", kind="file", weights_bytes=2 * GiB)
    models = MODELS.model_copy(update={"models": {"one.gguf": one}})
    resolved = bind(
        models=models, engine="llamacpp", model="one.gguf", engine_config={"context_length": 8192}
    )
    assert resolved.weights_bytes == 2 * GiB


# --- binding to a host: residency -----------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "weights_size", "expected", "why"),
    [
        (UNIFIED, 8 * GiB, Residency.DEEP, "unified memory"),
        # 1.5 x 8 GiB + 4 GiB = 16 GiB
        (HostFacts(False, 16 * GiB, ("gpu0",)), 8 * GiB, Residency.HOST_BACKED, "fits"),
        (HostFacts(False, 16 * GiB - 1, ("gpu0",)), 8 * GiB, Residency.DEEP, "exceeds"),
        (HostFacts(False, None, ("gpu0",)), 8 * GiB, Residency.DEEP, "parked room is unknown"),
        (DISCRETE, None, Residency.DEEP, "weights is unknown"),
    ],
)
def test_the_default_residency_follows_the_memory_and_the_parked_room(
    host: HostFacts, weights_size: int | None, expected: Residency, why: str
) -> None:
    models = HostModels(models_root=ROOT, models={"M": folder(f"{ROOT}/M", weights_size)})
    for engine in ("vllm", "sglang"):
        resolved = bind(host=host, models=models, engine=engine, model="M")
        assert resolved.residency == expected
        assert why in resolved.residency_reason


@pytest.mark.parametrize("host", [UNIFIED, DISCRETE])
def test_llamacpp_is_always_restart_only(host: HostFacts) -> None:
    resolved = bind(host=host, engine="llamacpp", engine_config={"context_length": 8192})
    assert resolved.residency == Residency.RESTART_ONLY
    assert "cannot park" in resolved.residency_reason


@pytest.mark.parametrize(
    ("host", "residency"),
    [(DISCRETE, "host_backed"), (DISCRETE, "deep"), (UNIFIED, "deep"), (UNIFIED, "restart_only")],
)
def test_a_declared_residency_the_host_can_do_is_kept(host: HostFacts, residency: str) -> None:
    resolved = bind(host=host, residency=residency)
    assert resolved.residency == residency
    assert resolved.residency_reason == "declared"


def test_host_backed_on_unified_memory_is_refused() -> None:
    with pytest.raises(CapyError) as caught:
        bind(host=UNIFIED, residency="host_backed")
    assert caught.value.code == "host_backed_unavailable"
    assert caught.value.exit_code == 5
    assert caught.value.message.startswith("deployment 'qwen3-4b': residency: host_backed")


@pytest.mark.parametrize("residency", ["deep", "host_backed"])
def test_a_park_tier_the_engine_cannot_do_is_refused(residency: str) -> None:
    with pytest.raises(CapyError) as caught:
        bind(engine="llamacpp", residency=residency, engine_config={"context_length": 8192})
    assert caught.value.code == "capability_missing:deep_park"
    assert caught.value.exit_code == 5
    assert f"residency: llamacpp 6500 cannot park ({residency}); use restart_only" in (
        caught.value.message
    )


# --- binding to a host: engine configuration and devices ------------------------------------


def test_extra_args_pass_when_they_touch_nothing_capyctl_sets() -> None:
    args = ["--max-num-batched-tokens", "8192", "--enable-prefix-caching"]
    resolved = bind(engine_config={"extra_args": args})
    assert resolved.extra_args == tuple(args)


@pytest.mark.parametrize(
    ("engine", "arg", "says"),
    [
        ("vllm", "--port=9000", "--port is reserved"),
        ("vllm", "--served", "abbreviates the reserved --served-model-name"),
        ("sglang", "--mem-fraction-static", "is reserved"),
        ("llamacpp", "-c", "short option"),
    ],
)
def test_extra_args_that_touch_what_capyctl_sets_are_refused(
    engine: str, arg: str, says: str
) -> None:
    config = {"extra_args": [arg], "context_length": 8192}
    with pytest.raises(InvalidConfig) as caught:
        bind(engine=engine, engine_config=config)
    assert caught.value.code == "invalid_config"
    assert "deployment 'qwen3-4b': engine_config.extra_args: " in caught.value.message
    assert says in caught.value.message


def test_llamacpp_needs_a_context_length() -> None:
    with pytest.raises(InvalidConfig, match=r"engine_config\.context_length is required"):
        bind(engine="llamacpp")


def test_a_pinned_gpu_the_host_has_is_used() -> None:
    assert bind(devices=[{"id": "gpu1"}]).devices == ("gpu1",)
    assert bind().devices == ()


def test_a_pinned_gpu_the_host_lacks_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidConfig) as caught:
        bind(devices=[{"id": "gpu7"}])
    assert caught.value.code == "invalid_config"
    assert "devices[0].id: gpu7 is not on this host (GPUs: gpu0, gpu1)" in caught.value.message
