"""The facts hostd publishes of its models: what it reads off a folder (and what it will not
read), and the record a real hostd keeps current under its host's prefix."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capycommon.deployments.checkpoint import quantization
from capycommon.domain.commands import Describe
from capycommon.domain.models import HostModels, ModelFacts, QuantizationConfig
from capycommon.engines.launch import MODELOPT_FP4
from capycommon.state import keys
from capyctl_hostd.modelfacts import MAX_CONFIG_BYTES, describe, locate, scan, survey
from integration.hostd.harness import HOST, Hostd
from support import short_dir, wait_for

GiB = 1 << 30


def files(folder: Path, **sizes: int) -> Path:
    """A folder whose files have the given sizes (sparse: no disk is used); `a_bin` is a.bin."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, size in sizes.items():
        with (folder / name.replace("_", ".")).open("wb") as file:
            file.truncate(size)
    return folder


def configs(folder: Path, **documents: Any) -> Path:
    """A folder of sparse weights with the given JSON config files (`config` is config.json)."""
    files(folder, model_safetensors=GiB)
    for name, content in documents.items():
        (folder / f"{name}.json").write_text(json.dumps(content))
    return folder


# --- one model path ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ({"a_safetensors": 3 * GiB, "b_safetensors": 2 * GiB, "config_json": 4096}, 5 * GiB),
        ({"model_safetensors": 3 * GiB, "pytorch_model_bin": 3 * GiB}, 3 * GiB),
        ({"pytorch_model_bin": 2 * GiB, "extra_pt": GiB}, 3 * GiB),
        ({"q4_gguf": 5 * GiB}, 5 * GiB),
        ({"config_json": 4096}, None),
    ],
)
def test_the_weights_are_the_files_the_engine_loads(
    tmp_path: Path, sizes: dict[str, int], expected: int | None
) -> None:
    facts = describe(files(tmp_path / "M", **sizes))
    assert (facts.kind, facts.weights_bytes) == ("folder", expected)


def test_a_weights_file_is_a_model_and_other_files_hold_no_weights(tmp_path: Path) -> None:
    files(tmp_path, one_gguf=2 * GiB, notes_txt=10)
    one = describe(tmp_path / "one.gguf")
    assert (one.path, one.kind, one.weights_bytes) == (str(tmp_path / "one.gguf"), "file", 2 * GiB)
    assert describe(tmp_path / "notes.txt").weights_bytes is None
    missing = describe(tmp_path / "nothing")
    assert (missing.path, missing.kind) == (str(tmp_path / "nothing"), "missing")
    assert describe(Path("/dev/null")).kind == "other"


def test_config_json_gives_the_architecture_dtype_and_quantization(tmp_path: Path) -> None:
    folder = configs(
        tmp_path / "m",
        config={
            "architectures": ["Qwen3ForCausalLM"],
            "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
        },
    )
    facts = describe(folder)
    assert facts.architectures == ("Qwen3ForCausalLM",)
    assert facts.dtype == "bfloat16"
    assert facts.quantization == (QuantizationConfig(file="config.json", quant_method="fp8"),)
    configs(folder, config={"architectures": ["X"], "dtype": "float16", "torch_dtype": "x"})
    assert describe(folder).dtype == "float16", "the newer name first"


def test_config_json_gives_the_head_counts_a_tensor_parallel_size_must_divide(
    tmp_path: Path,
) -> None:
    folder = configs(tmp_path / "m", config={"num_attention_heads": 64, "num_key_value_heads": 8})
    assert (describe(folder).attention_heads, describe(folder).kv_heads) == (64, 8)
    # A multimodal model keeps its language model's counts in text_config.
    configs(folder, config={"text_config": {"num_attention_heads": 40, "num_key_value_heads": 8}})
    assert (describe(folder).attention_heads, describe(folder).kv_heads) == (40, 8)
    # What is no positive count is not a count.
    configs(folder, config={"num_attention_heads": "64", "num_key_value_heads": True})
    assert (describe(folder).attention_heads, describe(folder).kv_heads) == (None, None)
    configs(folder, config={"num_attention_heads": 0, "num_key_value_heads": -2})
    assert (describe(folder).attention_heads, describe(folder).kv_heads) == (None, None)


NVFP4_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "quantization_config": {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "group_size": 16,
        "ignore": ["lm_head"],
    },
}
HF_QUANT_CONFIG = {
    "producer": {"name": "modelopt", "version": "0.19.0"},
    "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16},
}


@pytest.mark.parametrize(
    ("documents", "evidence"),
    [
        (
            {"config": NVFP4_CONFIG},
            "config.json: quantization_config.quant_method modelopt, quant_algo NVFP4",
        ),
        (
            {"config": {"quantization_config": {"quant_method": "modelopt_fp4"}}},
            "config.json: quantization_config.quant_method modelopt_fp4",
        ),
        (
            {"config": {"architectures": ["X"]}, "hf_quant_config": HF_QUANT_CONFIG},
            "hf_quant_config.json: quantization.quant_algo NVFP4",
        ),
        (
            {"hf_quant_config": {"quant_algo": "W4A8_NVFP4_FP8"}},
            "hf_quant_config.json: quantization.quant_algo W4A8_NVFP4_FP8",
        ),
    ],
)
def test_a_modelopt_fp4_checkpoint_is_recognised_from_its_files(
    tmp_path: Path, documents: dict[str, dict[str, Any]], evidence: str
) -> None:
    folder = configs(tmp_path / "m", **documents)
    found = quantization(describe(folder))
    assert found is not None
    assert found.kind == MODELOPT_FP4
    assert found.evidence == f"{folder}/{evidence}"


def test_unreadable_config_files_say_nothing(tmp_path: Path) -> None:
    folder = configs(tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    (folder / "hf_quant_config.json").write_bytes(b"\xff\xfe")
    facts = describe(folder)
    assert (facts.architectures, facts.dtype, facts.quantization) == ((), None, ())
    (folder / "config.json").write_text('["a list"]')
    assert describe(folder).architectures == ()


def test_only_small_regular_files_are_read(tmp_path: Path) -> None:
    folder = configs(tmp_path / "m")
    big = {"architectures": ["Big"], "pad": "x" * 100}
    (folder / "config.json").write_text(json.dumps(big))
    with (folder / "config.json").open("r+b") as file:
        file.truncate(MAX_CONFIG_BYTES + 1)  # a config this big is not one: never read
    assert describe(folder).architectures == ()
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")  # would block a plain open() forever
    (folder / "hf_quant_config.json").symlink_to("/dev/zero")  # would never end
    facts = describe(folder)
    assert (facts.architectures, facts.quantization, facts.weights_bytes) == ((), (), GiB)


def test_linked_weights_count_as_the_engine_loads_them(tmp_path: Path) -> None:
    """A Hugging Face snapshot links each file to a blob; a linked folder is not weights."""
    blobs = files(tmp_path / "blobs", abc=3 * GiB)
    (blobs / "cfg").write_text(json.dumps({"architectures": ["Linked"]}))
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model.safetensors").symlink_to(blobs / "abc")
    (snapshot / "config.json").symlink_to(blobs / "cfg")
    (snapshot / "dir.safetensors").symlink_to(blobs)
    (snapshot / "gone.safetensors").symlink_to(tmp_path / "nowhere")
    facts = describe(snapshot)
    assert (facts.weights_bytes, facts.architectures) == (3 * GiB, ("Linked",))


def test_a_path_is_found_where_a_deployment_means_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = tmp_path / "models"
    assert locate("Qwen3-4B", root) == root / "Qwen3-4B"
    assert locate("org/name", root) == root / "org" / "name"
    assert locate("/data/m", root) == Path("/data/m")
    assert locate("~/m", root) == tmp_path / "home" / "m"
    assert locate("~capyctl-no-such-user/m", root) is None


# --- the models root, and what was asked for -----------------------------------------------


def test_the_root_lists_its_models_without_following_links_out(tmp_path: Path) -> None:
    root = tmp_path / "models"
    files(root / "Qwen3-4B", config_json=2, model_safetensors=8 * GiB)
    files(root / "org" / "name", config_json=2)
    files(root / "org" / "name" / "inner", model_safetensors=GiB)  # inside a model: not one
    files(root, one_gguf=GiB, readme_txt=1)
    files(root / "notes", readme_txt=1)
    files(root / "a" / "b" / "c", config_json=2)  # too deep
    files(root / ".cache" / "x", config_json=2)  # hidden
    outside = files(tmp_path / "outside", model_safetensors=GiB)
    (root / "linked").symlink_to(outside)
    (root / "loop").symlink_to(root)
    found = scan(root)
    assert sorted(found) == ["Qwen3-4B", "one.gguf", "org/name"]
    assert found["Qwen3-4B"] == ModelFacts(
        path=str(root / "Qwen3-4B"), kind="folder", weights_bytes=8 * GiB
    )
    assert found["org/name"].weights_bytes is None
    assert scan(tmp_path / "no-such-root") == {}


def test_paths_asked_for_are_described_under_the_name_the_deployment_gives(
    tmp_path: Path,
) -> None:
    root = files(tmp_path / "models" / "listed", model_safetensors=GiB).parent
    linked = files(tmp_path / "outside", model_safetensors=2 * GiB)
    (root / "linked").symlink_to(linked)
    record = survey(root, [str(linked), "linked", "missing", "~capyctl-no-such-user/m"])
    assert record.models_root == str(root)
    assert list(record.models) == ["listed"]
    assert record.described == {
        str(linked): ModelFacts(path=str(linked), kind="folder", weights_bytes=2 * GiB),
        "linked": ModelFacts(path=str(root / "linked"), kind="folder", weights_bytes=2 * GiB),
        "missing": ModelFacts(path=str(root / "missing"), kind="missing"),
        "~capyctl-no-such-user/m": ModelFacts(path="~capyctl-no-such-user/m", kind="no_home"),
    }
    assert record.find("linked") == record.described["linked"]
    assert record.find("listed/") == record.models["listed"]


# --- a real hostd ---------------------------------------------------------------------------


@pytest.fixture
def bare_hostd(redis_socket: Path) -> Iterator[Hostd]:
    """hostd with no engines, its models root the default `~/models`, holding `small`."""
    root = short_dir("hostd")
    harness = Hostd(state=root / "state", home=root / "home", redis_socket=redis_socket)
    harness.state.mkdir(mode=0o700, parents=True)
    configs(harness.home / "models" / "small", config={"architectures": ["LlamaForCausalLM"]})
    harness.start()
    yield harness
    harness.stop()
    shutil.rmtree(root, ignore_errors=True)


def published(harness: Hostd) -> HostModels:
    """hostd's models as it published them; it publishes them once it starts, which may come
    after its first heartbeat (what the harness waits for)."""
    return wait_for(
        lambda: harness.read(lambda s: s.host_models.get(HOST)),
        timeout=15,
        what="hostd to publish its models, as it does when it starts",
    )


def test_hostd_publishes_its_models_and_keeps_them_current(bare_hostd: Hostd) -> None:
    harness = bare_hostd
    root = harness.home / "models"
    record = published(harness)
    assert record.models_root == str(root)
    assert record.models["small"].architectures == ("LlamaForCausalLM",)
    assert record.models["small"].weights_bytes == GiB

    files(root / "late", model_safetensors=3 * GiB)
    shutil.rmtree(root / "small")
    wait_for(
        lambda: sorted(published(harness).models) == ["late"],
        timeout=20,
        what="the next look at the models root",
    )
    assert published(harness).models["late"].weights_bytes == 3 * GiB


def test_hostd_describes_what_it_is_asked_and_remembers_it(bare_hostd: Hostd) -> None:
    harness = bare_hostd
    elsewhere = configs(harness.home / "elsewhere", hf_quant_config=HF_QUANT_CONFIG)
    pubsub = harness.client.pubsub()  # type: ignore[no-untyped-call]
    pubsub.subscribe(keys.host_notifications(HOST))
    asked = Describe(paths=(str(elsewhere), "~/elsewhere", "missing"))
    harness.client.xadd(keys.host_commands(HOST), {"command": asked.model_dump_json()})

    wait_for(lambda: published(harness).described, timeout=10, what="the paths described")
    record = published(harness)
    assert sorted(record.described) == sorted(asked.paths)
    assert record.described["~/elsewhere"] == record.described[str(elsewhere)]
    found = quantization(record.described[str(elsewhere)])
    assert found is not None
    assert found.kind == MODELOPT_FP4
    assert record.described["missing"].kind == "missing"
    notes = [pubsub.get_message(timeout=1) for _ in range(3)]
    kinds = [json.loads(n["data"])["kind"] for n in notes if n and n["type"] == "message"]
    assert "models" in kinds

    harness.stop()
    harness.start()
    assert sorted(published(harness).described) == sorted(asked.paths), "kept over a restart"
    files(harness.home / "models" / "missing", model_safetensors=GiB)
    wait_for(
        lambda: published(harness).described["missing"].kind == "folder",
        timeout=20,
        what="the asked-for path to appear",
    )

    fewer = Describe(paths=("missing",))
    harness.client.xadd(keys.host_commands(HOST), {"command": fewer.model_dump_json()})
    wait_for(
        lambda: list(published(harness).described) == ["missing"],
        timeout=10,
        what="the shorter list to replace the longer",
    )
