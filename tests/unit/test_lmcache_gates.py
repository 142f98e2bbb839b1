"""LMCache beside a deployment: its conditions (gates), what `auto`, `off` and `required` make
of each, the reserved flags, and how the server and the engines are wired."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from capycommon.deployments import HostFacts, Resolved, parse_deployment, resolve
from capycommon.deployments.load import revision_digest
from capycommon.domain.models import HostModels, ModelFacts
from capycommon.engines import lmcache
from capycommon.engines.families import Family, check_supported
from capycommon.engines.registry import EngineProfile
from capycommon.errors import CapyError, EngineUnsupported
from support import engine_profile

GiB = 1 << 30
HOST = HostFacts(unified=False, parked_room=32 * GiB, gpus=("gpu0",))
VLLM = engine_profile(Family.VLLM, "v32").model_copy(update={"version": "0.32.0"})
SGLANG = engine_profile(Family.SGLANG, "sg22").model_copy(update={"version": "0.5.22"})
OLD_VLLM = engine_profile(Family.VLLM, "v29")
LLAMA = engine_profile(Family.LLAMACPP, "llama")
# LMCache in each engine's own environment (the engines load its connector from there).
CACHE = engine_profile(Family.LMCACHE, "lmcache").model_copy(
    update={"install_path": VLLM.install_path, "executable": VLLM.executable}
)
CACHE_SG = CACHE.model_copy(
    update={
        "name": "lmcache-sg",
        "install_path": SGLANG.install_path,
        "executable": SGLANG.executable,
    }
)
PROFILES = {p.name: p for p in (VLLM, SGLANG, OLD_VLLM, LLAMA, CACHE, CACHE_SG)}
ROOT = "/srv/models"


def models(*architectures: str) -> HostModels:
    facts = ModelFacts(
        path=f"{ROOT}/m", kind="folder", weights_bytes=8 * GiB, architectures=architectures
    )
    return HostModels(models_root=ROOT, models={"m": facts})


def bind(
    engine: str = "v32",
    host: HostFacts = HOST,
    profiles: dict[str, EngineProfile] | None = None,
    architectures: tuple[str, ...] = (),
    **fields: Any,
) -> Resolved:
    fields.setdefault("residency", "restart_only")
    if engine == "llama":
        fields.setdefault("engine_config", {"context_length": 4096})
    document = parse_deployment({"name": "m", "engine": engine, "model": "m", **fields}, "t.yaml")
    return resolve(
        document, profiles=profiles or PROFILES, models=models(*architectures), host=host
    )


def test_a_qualified_deployment_runs_with_the_registered_lmcache_and_its_pool() -> None:
    for engine, cache in (("v32", CACHE), ("sg22", CACHE_SG)):
        found = bind(engine)
        assert found.cache == cache
        assert found.cache_pool == 4 * GiB
        assert found.cache_note == f"on: LMCache 0.5.6 ({cache.name}), pool 4.0 GiB"
    assert bind(lmcache_pool="10GiB").cache_pool == 10 * GiB


# Each gate: the document fields (or host) that close it, and its name.
CLOSED: list[tuple[str, dict[str, Any], str]] = [
    ("retention_zero", {"retention": "zero"}, "retention: zero never starts LMCache"),
    ("engine", {"engine": "v29"}, "vllm 0.29.0 is not qualified"),
    ("engine", {"engine": "llama"}, "llamacpp 6500 is not qualified"),
    ("residency", {"residency": "deep"}, "no parking of the engine is qualified with LMCache"),
    ("residency", {"residency": "host_backed"}, "set residency: restart_only"),
    (
        "radix_cache_disabled",
        {"engine": "sg22", "engine_config": {"extra_args": ["--disable-radix-cache"]}},
        "--disable-radix-cache",
    ),
    (
        "radix_cache_disabled",
        {"engine": "sg22", "engine_config": {"extra_args": ["--disable-radix"]}},
        "--disable-radix-cache",
    ),
    (
        "hierarchical_cache",
        {"engine": "sg22", "engine_config": {"extra_args": ["--enable-hierarchical-cache"]}},
        "--enable-hierarchical-cache",
    ),
    (
        "hybrid_model",
        {"engine": "sg22", "architectures": ("Qwen3NextForCausalLM",)},
        "this one is Qwen3NextForCausalLM",
    ),
    (
        "chunk_size",
        {"engine_config": {"extra_args": ["--block-size", "48"]}},
        "not a multiple of --block-size 48",
    ),
    (
        "chunk_size",
        {"engine": "sg22", "engine_config": {"extra_args": ["--page-size=7"]}},
        "--page-size 7",
    ),
]


@pytest.mark.parametrize(("gate", "fields", "said"), CLOSED, ids=[c[0] for c in CLOSED])
def test_auto_runs_without_lmcache_where_a_gate_is_closed_and_says_which(
    gate: str, fields: dict[str, Any], said: str
) -> None:
    found = bind(**fields)
    assert found.cache is None
    assert found.cache_pool == 0
    assert found.cache_note.startswith("off: ")
    assert said in found.cache_note
    assert found.cache_note.endswith(f"[{gate}]")


@pytest.mark.parametrize(("gate", "fields", "said"), CLOSED, ids=[c[0] for c in CLOSED])
def test_required_fails_naming_the_closed_gate(
    gate: str, fields: dict[str, Any], said: str
) -> None:
    with pytest.raises(CapyError) as refused:
        bind(lmcache="required", **fields)
    assert refused.value.code == f"lmcache_unavailable:{gate}"
    assert refused.value.exit_code == 5
    assert "lmcache: required, but" in refused.value.message
    assert said in refused.value.message


def test_the_hosts_own_settings_close_gates() -> None:
    off = bind(host=replace(HOST, lmcache=False))
    assert off.cache is None
    assert off.cache_note.endswith("[host_off]")
    zero = bind(host=replace(HOST, retention_zero=True))
    assert zero.cache_note.endswith("[retention_zero]")
    assert bind(host=replace(HOST, retention_zero=True), retention="default").cache == CACHE


def test_no_registered_lmcache_or_an_unqualified_one_closes_its_gate() -> None:
    without = {n: p for n, p in PROFILES.items() if p.family != Family.LMCACHE}
    assert bind(profiles=without).cache_note.endswith("[not_registered]")
    old = {**without, "old": CACHE.model_copy(update={"name": "old", "version": "0.5.4"})}
    elsewhere = {**without, "apart": CACHE.model_copy(update={"install_path": Path("/opt/lmc")})}
    with pytest.raises(CapyError) as refused:
        bind(profiles=elsewhere, lmcache="required")
    assert refused.value.code == "lmcache_unavailable:connector"
    assert "capyctl engine add /opt/vllm --family lmcache" in refused.value.message
    with pytest.raises(CapyError) as refused:
        bind(profiles=old, lmcache="required")
    assert refused.value.code == "lmcache_unavailable:lmcache_version"
    assert "old 0.5.4" in refused.value.message


def test_off_never_runs_lmcache() -> None:
    found = bind(lmcache="off")
    assert found.cache is None
    assert found.cache_note == "off (lmcache: off)"


def test_the_flags_that_connect_an_engine_are_reserved_while_lmcache_runs() -> None:
    for flag in ("--kv-transfer-config", "--enable-lmcache", "--lmcache-config-file", "--kv-tr"):
        engine = "v32" if flag.startswith("--kv") else "sg22"
        whole = "--kv-transfer-config" if flag == "--kv-tr" else flag
        with pytest.raises(CapyError, match=f"{whole} is reserved while the model runs"):
            bind(engine, engine_config={"extra_args": [flag, "x"]})
        found = bind(engine, lmcache="off", engine_config={"extra_args": [flag, "x"]})
        assert found.cache is None, "without LMCache the flag is the user's"


def test_lmcache_variables_are_reserved_in_a_deployment() -> None:
    for name in ("LMCACHE_CONFIG_FILE", "PYTHONHASHSEED", "LMCACHE_TRACK_USAGE"):
        with pytest.raises(CapyError) as refused:
            bind(engine_config={"env": {name: "1"}})
        assert refused.value.code == f"engine_env_reserved:{name}"


def test_a_deployment_cannot_name_lmcache_as_its_engine() -> None:
    with pytest.raises(CapyError, match="a KV cache, not an engine"):
        bind("lmcache")


def test_a_document_without_lmcache_keeps_its_digest() -> None:
    plain = parse_deployment({"name": "m", "engine": "vllm", "model": "m"}, "t.yaml")
    document = plain.model_dump(mode="json")
    assert "lmcache" in document
    expected = revision_digest(plain)
    stated = parse_deployment(
        {"name": "m", "engine": "vllm", "model": "m", "lmcache": "auto"}, "t.yaml"
    )
    assert revision_digest(stated) != expected, "stating it is a new revision"
    del document["lmcache"], document["lmcache_pool"], document["placement"], document["api"]
    del document["resources"]  # added later still, and left out alike
    del document["engine_config"]["tensor_parallel"]  # the same, added with multi-GPU models
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert expected == "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def test_only_lmcache_0_5_6_and_later_0_5_releases_register() -> None:
    check_supported(Family.LMCACHE, "0.5.6")
    check_supported(Family.LMCACHE, "0.5.7.post1")
    for version, said in (("0.5.5", "older than 0.5.6"), ("0.6.0", "0.6 or later")):
        with pytest.raises(EngineUnsupported, match=said):
            check_supported(Family.LMCACHE, version)


def test_the_hash_seed_is_fixed_per_revision() -> None:
    seed = lmcache.hash_seed("m", 3)
    assert seed == lmcache.hash_seed("m", 3)
    assert seed.isdigit()
    assert 0 <= int(seed) <= 4294967295, "the range PYTHONHASHSEED takes"
    assert seed != lmcache.hash_seed("m", 4)
    assert seed != lmcache.hash_seed("n", 3)


PORTS = lmcache.ServerPorts(zmq=8150, http=8151, metrics=8152)


def test_the_server_listens_on_loopback_on_leased_ports_with_its_pool() -> None:
    argv = lmcache.server_argv(CACHE, PORTS, 4 * GiB + GiB // 2)
    assert argv == [
        "/opt/vllm/bin/python",
        "-m",
        "lmcache.v1.multiprocess.http_server",
        "--host",
        "127.0.0.1",
        "--port",
        "8150",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        "8151",
        "--prometheus-port",
        "8152",
        "--l1-size-gb",
        "4.5",
        "--eviction-policy",
        "LRU",
        "--chunk-size",
        "256",
        "--max-workers",
        "1",
    ]
    env = lmcache.server_env("123", "GPU-abc")
    assert env == {
        "DO_NOT_TRACK": "1",
        "LMCACHE_TRACK_USAGE": "false",
        "PYTHONHASHSEED": "123",
        "CUDA_VISIBLE_DEVICES": "GPU-abc",
    }


def test_vllm_connects_through_the_mp_connector(tmp_path: Path) -> None:
    argv, env = lmcache.engine_wiring(Family.VLLM, PORTS, "123", tmp_path)
    assert argv[0] == "--kv-transfer-config"
    assert json.loads(argv[1]) == {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": 8150,
            "lmcache.mp.autostart": False,
        },
    }
    assert env == {"PYTHONHASHSEED": "123", "LMCACHE_TRACK_USAGE": "false"}


def test_sglang_connects_through_its_config_file(tmp_path: Path) -> None:
    argv, env = lmcache.engine_wiring(Family.SGLANG, PORTS, "123", tmp_path)
    file = tmp_path / "lmcache.yaml"
    assert argv == ["--enable-lmcache", "--lmcache-config-file", str(file)]
    assert file.read_text() == "mp_host: 127.0.0.1\nmp_port: 8150\n"
    assert env == {
        "PYTHONHASHSEED": "123",
        "LMCACHE_TRACK_USAGE": "false",
        "LMCACHE_CONFIG_FILE": str(file),
    }


def test_a_pool_below_one_gib_is_refused() -> None:
    with pytest.raises(CapyError, match="below 1GiB, the smallest LMCache pool"):
        bind(lmcache_pool="512MiB")
