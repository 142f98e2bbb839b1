"""The adapters: golden argv per family and residency, extra-argument checks, capabilities."""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from capycommon.domain.commands import EngineTuning
from capycommon.domain.engines import Residency
from capycommon.engines.adapters import adapter_for
from capycommon.engines.families import ENGINE_FAMILIES, Family
from capycommon.engines.launch import LaunchPlan, LaunchSpec
from capycommon.engines.registry import EngineProfile
from capycommon.engines.runtime import capyctl_sglang_launch
from capycommon.errors import InvalidConfig

GOLDEN = Path(__file__).parent / "golden"
KEY = "per-launch-key-0123456789abcdef0123456789"

EXECUTABLES = {
    Family.VLLM: Path("/opt/engines/vllm/bin/python"),
    Family.SGLANG: Path("/opt/engines/sglang/bin/python"),
    Family.LLAMACPP: Path("/opt/llama.cpp/build/bin/llama-server"),
    Family.TENSORFOLD: Path("/opt/tensorfold/bin/tensorfold"),
    Family.CUSTOM: Path("/opt/tgi/bin/text-generation-launcher"),
}
# A custom engine: text-generation-inference as docs/engines.md registers it.
TGI = (
    "/opt/tgi/bin/text-generation-launcher",
    "--model-id",
    "{model}",
    "--hostname",
    "{host}",
    "--port",
    "{port}",
    "--served-model-name",
    "{served_name}",
    "--max-concurrent-requests",
    "16",
)
CASES = [
    (Family.VLLM, Residency.HOST_BACKED),
    (Family.VLLM, Residency.DEEP),
    (Family.VLLM, Residency.RESTART_ONLY),
    (Family.SGLANG, Residency.HOST_BACKED),
    (Family.SGLANG, Residency.DEEP),
    (Family.SGLANG, Residency.RESTART_ONLY),
    (Family.LLAMACPP, Residency.RESTART_ONLY),
    (Family.TENSORFOLD, Residency.RESTART_ONLY),
    (Family.CUSTOM, Residency.RESTART_ONLY),
]
VERSIONS = {Family.LLAMACPP: "6500", Family.TENSORFOLD: "0.6.6", Family.CUSTOM: "3.3.4"}


EXTRA_ARGS = {
    Family.LLAMACPP: ("--temp", "0.7"),
    Family.TENSORFOLD: ("--thinking", "off"),
    Family.CUSTOM: ("--max-input-tokens", "4096"),
}


def profile(family: Family, version: str = "0.29.0") -> EngineProfile:
    executable = EXECUTABLES[family]
    custom = family == Family.CUSTOM
    return EngineProfile(
        name=family.value,
        family=family,
        version=VERSIONS.get(family, version),
        executable=executable,
        install_path=executable.parents[1],
        fingerprint="0.29.0+sha256:" + "0" * 64,
        verified=False,
        added_at=datetime(2026, 11, 30, tzinfo=UTC),
        command=TGI if custom else (),
        ready_path="/health" if custom else None,
        key_env="CAPY_TGI_KEY" if custom else None,
    )


def spec(family: Family, residency: Residency, models: Path, **changes: object) -> LaunchSpec:
    """The golden launch of `family`, with `changes` to its fields or to its tuning's."""
    model = models / "qwen3-4b"
    model.mkdir(exist_ok=True)
    (model / "qwen3-4b-q4.gguf").touch()
    tuning: dict[str, object] = {
        "memory_fraction": 0.4512345,
        "gpu_memory_bytes": 20 * (1 << 30) + 123_456_789,
        "context_length": 8192,
        "max_concurrent_requests": 16,
        "tool_call_parser": "hermes",
        "reasoning_parser": "qwen3",
        "extra_args": EXTRA_ARGS.get(family, ("--enable-prefix-caching",)),
    }
    tuning.update((key, changes.pop(key)) for key in tuning.keys() & changes.keys())
    values: dict[str, object] = {
        "profile": profile(family),
        "model_path": model,
        "served_name": "qwen3-4b",
        "port": 8123,
        "api_key": KEY,
        "residency": residency,
        "runtime_dir": Path("/state/runtime"),
        "tuning": EngineTuning.model_validate(tuning),
    }
    values.update(changes)
    return LaunchSpec(**values)  # type: ignore[arg-type]


def assert_golden(plan: LaunchPlan, models: Path, golden: Path) -> None:
    """The plan's argv and environment, with `models` written as <models>, are the golden
    file's; UPDATE_GOLDEN=1 writes the file instead."""
    rendered = json.dumps(
        {"argv": [arg.replace(str(models), "<models>") for arg in plan.argv], "env": plan.env},
        indent=2,
    )
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.write_text(rendered + "\n")
    assert golden.read_text() == rendered + "\n", f"regenerate with UPDATE_GOLDEN=1 ({golden})"


@pytest.mark.parametrize(("family", "residency"), CASES, ids=str)
def test_argv_matches_the_golden_file(tmp_path: Path, family: Family, residency: Residency) -> None:
    plan = adapter_for(family).plan(spec(family, residency, tmp_path))
    assert_golden(plan, tmp_path, GOLDEN / f"{family}-{residency}.json")


@pytest.mark.parametrize(
    ("family", "residency"),
    [(Family.SGLANG, Residency.HOST_BACKED), (Family.LLAMACPP, Residency.RESTART_ONLY)],
    ids=str,
)
def test_a_decision_models_argv_matches_the_golden_file(
    tmp_path: Path, family: Family, residency: Residency
) -> None:
    """SGLang with its radix cache off (no template override, speculative decoding or
    auto-truncation is possible: the resolution refuses them); llama.cpp with its batch and
    micro-batch at a slot's share of the context (8192 / 16 slots), so a whole prompt is one
    micro-batch."""
    decider = spec(
        family, residency, tmp_path, api="decisions", tool_call_parser=None, reasoning_parser=None
    )
    plan = adapter_for(family).plan(decider)
    assert_golden(plan, tmp_path, GOLDEN / f"{family}-decisions.json")


@pytest.mark.parametrize(
    ("family", "arg"),
    [(Family.SGLANG, "--chat-template=mine.jinja"), (Family.LLAMACPP, "--ubatch-size=64")],
)
def test_a_decision_launch_refuses_what_it_bars(tmp_path: Path, family: Family, arg: str) -> None:
    decider = spec(family, Residency.RESTART_ONLY, tmp_path, api="decisions", extra_args=(arg,))
    with pytest.raises(InvalidConfig, match="is barred for a decision model"):
        adapter_for(family).plan(decider)


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_the_key_stays_out_of_argv(tmp_path: Path, family: Family) -> None:
    residency = Residency.RESTART_ONLY
    plan = adapter_for(family).plan(spec(family, residency, tmp_path))
    assert KEY not in " ".join(plan.argv)
    assert KEY in plan.env.values()


@pytest.mark.parametrize(
    ("family", "arg", "reason"),
    [
        (Family.VLLM, "--port", "--port is reserved"),
        (Family.VLLM, "--port=9000", "--port is reserved"),
        (Family.VLLM, "--serv", "--serv abbreviates the reserved --served-model-name"),
        (Family.VLLM, "-tp", "is a short option"),
        (Family.SGLANG, "--mem-fraction-static", "is reserved"),
        (Family.SGLANG, "--enable-weights", "abbreviates the reserved --enable-weights-cpu-backup"),
        (Family.LLAMACPP, "--api-key-file", "is reserved"),
        (Family.LLAMACPP, "-c", "is a short option"),
    ],
)
def test_reserved_extra_args_are_refused(
    tmp_path: Path, family: Family, arg: str, reason: str
) -> None:
    residency = Residency.RESTART_ONLY
    with pytest.raises(InvalidConfig, match=reason):
        adapter_for(family).plan(spec(family, residency, tmp_path, extra_args=(arg, "1")))


FAKE_SERVER = """
import json, os, sys
record = {"argv": sys.argv[1:], "name": __name__, "env": os.environ.get("CAPYCTL_ENGINE_API_KEY")}
with open(os.environ["FAKE_SERVER_RECORD"], "w") as handle:
    json.dump(record, handle)
"""


def test_the_sglang_launcher_hands_the_key_to_the_server_as_one_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang reads its key from --api-key only: the launcher moves it from its environment
    into the server's arguments, one token even with a leading "-", inside the process."""
    dashed = spec(Family.SGLANG, Residency.DEEP, tmp_path, api_key="-" + KEY)
    plan = adapter_for(Family.SGLANG).plan(dashed)
    assert plan.argv[1:3] == ["-m", "capyctl_sglang_launch"]
    assert plan.env["PYTHONPATH"] == str(dashed.runtime_dir)
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").touch()
    (tmp_path / "sglang" / "launch_server.py").write_text(FAKE_SERVER)
    record = tmp_path / "record.json"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["capyctl_sglang_launch.py", *plan.argv[3:]])
    monkeypatch.setenv("FAKE_SERVER_RECORD", str(record))
    for name, value in plan.env.items():
        monkeypatch.setenv(name, value)
    try:
        capyctl_sglang_launch.main()
    finally:
        sys.modules.pop("sglang", None)
    seen = json.loads(record.read_text())
    assert seen == {"argv": [*plan.argv[3:], f"--api-key=-{KEY}"], "name": "__main__", "env": None}


def test_option_values_may_look_like_anything(tmp_path: Path) -> None:
    extra = ("--override-generation-config", '{"temperature": 0.5}', "--seed", "7")
    plan = adapter_for(Family.VLLM).plan(
        spec(Family.VLLM, Residency.DEEP, tmp_path, extra_args=extra)
    )
    assert plan.argv[-4:] == list(extra)


def test_llamacpp_cannot_park_and_needs_a_context_length(tmp_path: Path) -> None:
    adapter = adapter_for(Family.LLAMACPP)
    with pytest.raises(InvalidConfig) as caught:
        adapter.plan(spec(Family.LLAMACPP, Residency.DEEP, tmp_path))
    assert caught.value.code == "capability_missing:deep_park"
    with pytest.raises(InvalidConfig, match="context_length is required"):
        adapter.plan(spec(Family.LLAMACPP, Residency.RESTART_ONLY, tmp_path, context_length=None))


def test_llamacpp_picks_the_first_part_of_a_split_model(tmp_path: Path) -> None:
    model = tmp_path / "big"
    model.mkdir()
    for name in ("big-00002-of-00002.gguf", "big-00001-of-00002.gguf", "mmproj.gguf"):
        (model / name).touch()
    plan = adapter_for(Family.LLAMACPP).plan(
        spec(Family.LLAMACPP, Residency.RESTART_ONLY, tmp_path, model_path=model)
    )
    assert plan.argv[plan.argv.index("-m") + 1] == str(model / "big-00001-of-00002.gguf")


# vLLM's capabilities that change with its version: the field of its answers' reasoning,
# and what becomes of the requests sent to it while it is parked.
VLLM_BY_VERSION = {
    "0.11.0": ("reasoning_content", "crash"),
    "0.16.0": ("reasoning", "crash"),
    "0.29.0": ("reasoning", "held"),
}


@pytest.mark.parametrize("version", VLLM_BY_VERSION)
def test_vllm_capabilities_follow_the_version(version: str) -> None:
    caps = adapter_for(Family.VLLM).capabilities(version)
    assert (caps.reasoning_field, caps.requests_while_parked) == VLLM_BY_VERSION[version]
    assert caps.request_id == "header"
    assert not caps.abort_by_id


def test_family_capabilities() -> None:
    sglang = adapter_for(Family.SGLANG).capabilities("0.5.16")
    assert sglang.abort_by_id
    assert sglang.park_needs_idle
    assert sglang.request_id == "body"
    llama = adapter_for(Family.LLAMACPP).capabilities("6500")
    assert llama.residencies == (Residency.RESTART_ONLY,)
    assert llama.metrics_running == "llamacpp:requests_processing"
