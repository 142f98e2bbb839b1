"""Park tiers on a host with deep parking off, and checkpoints an engine cannot park."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from capycommon.deployments import HostFacts, Resolved, parse_deployment, resolve
from capycommon.deployments.checkpoint import quantization
from capycommon.domain.commands import EngineTuning
from capycommon.domain.engines import PARKING, Residency
from capycommon.domain.models import HostModels, ModelFacts, QuantizationConfig
from capycommon.engines.adapters import adapter_for
from capycommon.engines.families import ENGINE_FAMILIES, Family
from capycommon.engines.launch import MODELOPT_FP4, LaunchSpec, host_tiers
from capycommon.errors import CapyError
from support import engine_profile

GiB = 1 << 30
R = Residency
DISCRETE = HostFacts(unified=False, parked_room=32 * GiB, gpus=("gpu0",))
OFF = HostFacts(unified=False, parked_room=32 * GiB, gpus=("gpu0",), deep_park=False)
UNIFIED_OFF = HostFacts(unified=True, parked_room=32 * GiB, gpus=("gpu0",), deep_park=False)


PROFILES = {family.value: engine_profile(family) for family in ENGINE_FAMILIES}


ROOT = "/srv/models"
FOLDER = f"{ROOT}/m"


def model(size: int = 8 * GiB, *stated: QuantizationConfig) -> HostModels:
    """The host's facts of one model folder `m`: its weights, and what its configs state."""
    facts = ModelFacts(path=FOLDER, kind="folder", weights_bytes=size, quantization=stated)
    return HostModels(models_root=ROOT, models={"m": facts})


def bind(models: HostModels, host: HostFacts, engine: str, **fields: Any) -> Resolved:
    document = parse_deployment({"name": "m", "engine": engine, "model": "m", **fields}, "t.yaml")
    return resolve(document, profiles=PROFILES, models=models, host=host)


# --- deep parking off -----------------------------------------------------------------------


def test_a_host_with_deep_parking_off_bars_deep_and_dev_control_tiers() -> None:
    vllm = adapter_for(Family.VLLM).capabilities("0.29.0")
    sglang = adapter_for(Family.SGLANG).capabilities("0.5.16")
    llama = adapter_for(Family.LLAMACPP).capabilities("6500")
    assert host_tiers(vllm, deep_park=True) == (R.HOST_BACKED, R.DEEP, R.RESTART_ONLY)
    assert host_tiers(vllm, deep_park=False) == (R.RESTART_ONLY,), "/sleep needs dev mode"
    assert host_tiers(sglang, deep_park=False) == (R.HOST_BACKED, R.RESTART_ONLY)
    assert host_tiers(llama, deep_park=False) == (R.RESTART_ONLY,)


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_no_launch_on_such_a_host_has_development_controls(tmp_path: Path, family: Family) -> None:
    capabilities = adapter_for(family).capabilities(engine_profile(family).version)
    (tmp_path / "m.gguf").touch()
    for tier in host_tiers(capabilities, deep_park=False):
        spec = LaunchSpec(
            profile=engine_profile(family),
            model_path=tmp_path,
            served_name="m",
            port=8100,
            api_key="k" * 64,
            residency=tier,
            runtime_dir=tmp_path / "runtime",
            tuning=EngineTuning(context_length=8192, gpu_memory_bytes=8 << 30),
        )
        plan = adapter_for(family).plan(spec)
        assert "VLLM_SERVER_DEV_MODE" not in plan.env
        assert "--enable-sleep-mode" not in plan.argv


@pytest.mark.parametrize(
    ("engine", "host", "size", "tier", "says"),
    [
        ("vllm", DISCRETE, 8 * GiB, R.HOST_BACKED, "fits the 32.0 GiB parked room"),
        (
            "vllm",
            OFF,
            8 * GiB,
            R.RESTART_ONLY,
            "fits the 32.0 GiB parked room; deep parking is off on this host "
            "(host.deep_park: off), and vllm parks host_backed only through its development "
            "controls, so it stops instead of parking",
        ),
        ("sglang", OFF, 8 * GiB, R.HOST_BACKED, "fits the 32.0 GiB parked room"),
        ("sglang", DISCRETE, 30 * GiB, R.DEEP, "exceeds the 32.0 GiB parked room"),
        (
            "sglang",
            OFF,
            30 * GiB,
            R.RESTART_ONLY,
            "exceeds the 32.0 GiB parked room; deep parking is off on this host (host.deep_park: "
            "off), so it stops instead of parking",
        ),
        (
            "sglang",
            UNIFIED_OFF,
            8 * GiB,
            R.RESTART_ONLY,
            "unified memory: a host copy would take the GPU's own memory; deep parking is off",
        ),
    ],
)
def test_the_default_stops_where_it_would_park_deep(
    engine: str, host: HostFacts, size: int, tier: Residency, says: str
) -> None:
    resolved = bind(model(size), host, engine)
    assert resolved.residency == tier
    assert says in resolved.residency_reason


@pytest.mark.parametrize(
    ("engine", "declared", "tier", "reason"),
    [
        (
            "sglang",
            "deep",
            R.RESTART_ONLY,
            "declared deep, but deep parking is off on this host (host.deep_park: off); it stops "
            "instead",
        ),
        (
            "vllm",
            "host_backed",
            R.RESTART_ONLY,
            "declared host_backed, but deep parking is off on this host (host.deep_park: off), "
            "and vllm parks host_backed only through its development controls; it stops instead",
        ),
        ("sglang", "host_backed", R.HOST_BACKED, "declared"),
        ("vllm", "restart_only", R.RESTART_ONLY, "declared"),
    ],
)
def test_a_declared_tier_the_host_bars_resolves_to_restart_only_with_a_note(
    engine: str, declared: str, tier: Residency, reason: str
) -> None:
    resolved = bind(model(), OFF, engine, residency=declared)
    assert (resolved.residency, resolved.residency_reason) == (tier, reason)


# --- ModelOpt FP4 checkpoints ---------------------------------------------------------------
# (tests/integration/hostd/test_model_facts.py reads these statements out of real config files)

NVFP4 = QuantizationConfig(file="config.json", quant_method="modelopt", quant_algo="NVFP4")
EXPORTED = QuantizationConfig(file="hf_quant_config.json", quant_algo="NVFP4")


@pytest.mark.parametrize(
    ("stated", "evidence"),
    [
        ((NVFP4,), "config.json: quantization_config.quant_method modelopt, quant_algo NVFP4"),
        (
            (QuantizationConfig(file="config.json", quant_method="ModelOpt_FP4"),),
            "config.json: quantization_config.quant_method modelopt_fp4",
        ),
        (
            (QuantizationConfig(file="config.json", quant_method="fp8"), EXPORTED),
            "hf_quant_config.json: quantization.quant_algo NVFP4",
        ),
        (
            (QuantizationConfig(file="hf_quant_config.json", quant_algo="W4A8_NVFP4_FP8"),),
            "hf_quant_config.json: quantization.quant_algo W4A8_NVFP4_FP8",
        ),
    ],
)
def test_a_modelopt_fp4_checkpoint_is_recognised(
    stated: tuple[QuantizationConfig, ...], evidence: str
) -> None:
    found = quantization(model(GiB, *stated).models["m"])
    assert found is not None
    assert found.kind == MODELOPT_FP4
    assert found.evidence == f"{FOLDER}/{evidence}"


@pytest.mark.parametrize(
    "stated",
    [
        (),
        (QuantizationConfig(file="config.json", quant_method="modelopt", quant_algo="FP8"),),
        (QuantizationConfig(file="hf_quant_config.json", quant_algo="FP8"),),
        (QuantizationConfig(file="config.json", quant_method="compressed-tensors"),),
        (QuantizationConfig(file="config.json", quant_algo="NVFP4"),),
    ],
)
def test_other_checkpoints_say_nothing(stated: tuple[QuantizationConfig, ...]) -> None:
    assert quantization(model(GiB, *stated).models["m"]) is None


def test_a_file_is_no_checkpoint_folder() -> None:
    file = ModelFacts(path=f"{ROOT}/m.gguf", kind="file", weights_bytes=GiB, quantization=(NVFP4,))
    assert quantization(file) is None


def test_sglang_defaults_an_nvfp4_checkpoint_to_restart_only() -> None:
    models = model(GiB, EXPORTED)
    resolved = bind(models, DISCRETE, "sglang")
    assert resolved.residency == R.RESTART_ONLY
    assert resolved.residency_reason == (
        "sglang cannot park a ModelOpt FP4 (NVFP4) checkpoint, and the model is one "
        f"({FOLDER}/hf_quant_config.json: quantization.quant_algo NVFP4)"
    )
    declared = bind(models, DISCRETE, "sglang", residency="restart_only")
    assert (declared.residency, declared.residency_reason) == (R.RESTART_ONLY, "declared")


@pytest.mark.parametrize("declared", [tier.value for tier in PARKING])
def test_sglang_refuses_to_park_an_nvfp4_checkpoint(declared: str) -> None:
    with pytest.raises(CapyError) as caught:
        bind(model(GiB, NVFP4), DISCRETE, "sglang", residency=declared)
    assert caught.value.code == "capability_missing:deep_park"
    assert caught.value.exit_code == 5
    assert caught.value.message == (
        f"deployment 'm': residency: {declared}: sglang cannot park a ModelOpt FP4 (NVFP4) "
        f"checkpoint, and the model is one ({FOLDER}/config.json: "
        "quantization_config.quant_method modelopt, quant_algo NVFP4); set residency: "
        "restart_only (or drop residency)"
    )


@pytest.mark.parametrize("declared", [tier.value for tier in PARKING])
def test_vllm_parks_an_nvfp4_checkpoint(declared: str) -> None:
    models = model(GiB, NVFP4)
    resolved = bind(models, DISCRETE, "vllm", residency=declared)
    assert (resolved.residency, resolved.residency_reason) == (declared, "declared")
    assert bind(models, DISCRETE, "vllm").residency == R.HOST_BACKED
