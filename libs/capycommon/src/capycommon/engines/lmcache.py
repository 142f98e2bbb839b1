"""LMCache: a private KV cache in host RAM for one model instance.

Each instance that runs with LMCache gets its own LMCache multi-process server, bound to
loopback, started before the engine and stopped after it. The engine connects to it: vLLM
through `--kv-transfer-config` (LMCache's MP connector), SGLang through `--enable-lmcache`
and a config file naming the server. Both run with the same fixed `PYTHONHASHSEED`, derived
from the deployment's revision, so an engine started again (a restart_only park, then a
request) finds the chunks the one before it stored.

`gate` says whether a deployment may run with LMCache on a host, and which condition fails
when it may not. The conditions are those this release qualifies: vLLM 0.32 or SGLang 0.5.22
and later, with LMCache 0.5.6 or a later 0.5.x registered; residency restart_only (deep
parking with LMCache is qualified nowhere); no retention: zero; the host not off; and, on
SGLang, what makes it bypass LMCache silently (its radix cache off, its hierarchical cache,
a hybrid attention model, a decision deployment).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from packaging.version import Version

from capycommon.domain.engines import Residency
from capycommon.engines.families import Family, parse_version
from capycommon.engines.launch import ENGINE_HOST
from capycommon.engines.registry import EngineProfile

GiB = 1 << 30
DEFAULT_POOL = 4 * GiB
# Tokens per chunk: a multiple of vLLM's block size (16 by default) and SGLang's page size.
CHUNK_SIZE = 256
# The module `lmcache server` runs (ZMQ and the HTTP API); present in every 0.5.x.
SERVER_MODULE = "lmcache.v1.multiprocess.http_server"
VLLM_CONNECTOR_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"
# The SGLang connector's file, in the launch's runtime folder.
SGLANG_CONFIG = "lmcache.yaml"
# The server's own resident memory (Python, torch, its HTTP API), charged until it is
# measured: an estimate, said so wherever it is shown.
SERVER_HOST_ESTIMATE = 2 * GiB
# The server's CUDA context on each GPU it serves (about 0.66 GiB measured on a discrete
# card), plus a margin for its staging buffers.
SERVER_DEVICE_ESTIMATE = 768 << 20

LMCACHE_RANGE = (Version("0.5.6"), Version("0.6"))
QUALIFIED_ENGINES: dict[Family, tuple[Version, Version]] = {
    Family.VLLM: (Version("0.32.0"), Version("0.33")),
    Family.SGLANG: (Version("0.5.22"), Version("0.6")),
}
# SGLang builds a hybrid model's cache (sliding window, Mamba/linear attention) as its own
# radix-cache kind, which never reaches LMCache. Architectures known to be such hybrids:
HYBRID_ARCHITECTURES = (
    "Mamba", "Jamba", "NemotronH", "FalconH1", "GraniteMoeHybrid", "Qwen3Next", "Qwen3_5",
    "Lfm2", "Gemma2", "Gemma3", "GptOss", "Llama4", "MiniMax", "Plamo2", "Zamba",
)  # fmt: skip

Setting = Literal["auto", "off", "required"]
Gate = Literal[
    "retention_zero",
    "host_off",
    "engine",
    "decisions",
    "not_registered",
    "lmcache_version",
    "connector",
    "residency",
    "radix_cache_disabled",
    "hierarchical_cache",
    "hybrid_model",
    "chunk_size",
]


@dataclass(frozen=True)
class Closed:
    """Why LMCache may not run: the gate (a stable name for `lmcache_unavailable:<gate>`)
    and a sentence with the fix."""

    gate: Gate
    why: str


@dataclass(frozen=True)
class GateFacts:
    """What the gate judges, gathered by the caller."""

    engine: EngineProfile
    residency: Residency
    extra_args: Sequence[str]
    architectures: Sequence[str]
    # The host's registered LMCache installations.
    installs: Sequence[EngineProfile]
    retention_zero: bool
    host_off: bool
    decisions: bool = False


def installs_of(profiles: Mapping[str, EngineProfile]) -> list[EngineProfile]:
    """The registered LMCache installations, by name."""
    return sorted(
        (p for p in profiles.values() if p.family == Family.LMCACHE), key=lambda p: p.name
    )


def qualified(install: EngineProfile) -> bool:
    low, high = LMCACHE_RANGE
    return low <= parse_version(Family.LMCACHE, install.version) < high


def gate(facts: GateFacts) -> EngineProfile | Closed:
    """The LMCache installation the deployment runs with on this host, or the first gate
    that is closed."""
    closed = _closed(facts)
    if closed is not None:
        return closed
    return next(p for p in _beside(facts) if qualified(p))


def _beside(facts: GateFacts) -> list[EngineProfile]:
    """The registered LMCache installations in the engine's own environment: the engine
    imports LMCache's connector (vLLM's `lmcache_mp_connector`, SGLang's adapter) from it."""
    return [p for p in facts.installs if p.install_path == facts.engine.install_path]


def _closed(facts: GateFacts) -> Closed | None:  # noqa: PLR0911 (one answer per gate)
    engine = facts.engine
    if facts.retention_zero:
        return Closed("retention_zero", "retention: zero never starts LMCache")
    if facts.host_off:
        return Closed("host_off", "LMCache is off on this host (host.lmcache: off)")
    span = QUALIFIED_ENGINES.get(engine.family)
    if span is None or not span[0] <= parse_version(engine.family, engine.version) < span[1]:
        return Closed(
            "engine",
            f"{engine.family} {engine.version} is not qualified with LMCache (vLLM 0.32, "
            "SGLang 0.5.22 or a later 0.5.x are)",
        )
    if facts.decisions and engine.family == Family.SGLANG:  # whatever LMCache is installed
        return Closed(
            "decisions",
            "a decision deployment on SGLang runs without LMCache (SGLang fails with it while "
            "its radix cache is off)",
        )
    if not facts.installs:
        return Closed(
            "not_registered",
            "no LMCache is registered on this host; install LMCache 0.5.6 or a later 0.5.x "
            "and register it with capyctl engine add PATH --family lmcache",
        )
    if not any(qualified(p) for p in facts.installs):
        found = ", ".join(f"{p.name} {p.version}" for p in facts.installs)
        return Closed(
            "lmcache_version",
            f"the registered LMCache ({found}) is not 0.5.6 or a later 0.5.x; register one that is",
        )
    if not any(qualified(p) for p in _beside(facts)):
        return Closed(
            "connector",
            f"the engine's environment ({engine.install_path}) has no registered LMCache 0.5.6 "
            "or later 0.5.x, and the engine loads LMCache's connector from it; install LMCache "
            f"there and register it: capyctl engine add {engine.install_path} --family lmcache",
        )
    if facts.residency != Residency.RESTART_ONLY:
        return Closed(
            "residency",
            f"its residency is {facts.residency}, and no parking of the engine is qualified "
            "with LMCache in this release; set residency: restart_only to use LMCache",
        )
    return _sglang_closed(facts) if engine.family == Family.SGLANG else _chunk_closed(facts)


def sets(args: Sequence[str], flag: str) -> bool:
    """Whether `args` set `flag`, whole or abbreviated (the engines' argparse takes any
    unambiguous prefix)."""
    return any(
        arg.startswith("--") and len(name := arg.split("=", 1)[0]) > 2 and flag.startswith(name)
        for arg in args
    )


def _sglang_closed(facts: GateFacts) -> Closed | None:
    if sets(facts.extra_args, "--disable-radix-cache"):
        return Closed(
            "radix_cache_disabled",
            "SGLang bypasses LMCache with its radix cache off (--disable-radix-cache in "
            "engine_config.extra_args); drop the flag",
        )
    if sets(facts.extra_args, "--enable-hierarchical-cache"):
        return Closed(
            "hierarchical_cache",
            "SGLang bypasses LMCache with its hierarchical cache (--enable-hierarchical-cache "
            "in engine_config.extra_args); drop the flag",
        )
    hybrid = next(
        (a for a in facts.architectures if any(h in a for h in HYBRID_ARCHITECTURES)), None
    )
    if hybrid is not None:
        return Closed(
            "hybrid_model",
            f"SGLang bypasses LMCache for a hybrid attention model, and this one is {hybrid} "
            "(config.json architectures)",
        )
    return _chunk_closed(facts)


def _chunk_closed(facts: GateFacts) -> Closed | None:
    """The chunk size must be a multiple of the engine's block (vLLM) or page (SGLang) size."""
    flag = "--block-size" if facts.engine.family == Family.VLLM else "--page-size"
    size = _flag_value(facts.extra_args, flag)
    if size is None:
        return None
    if not size.isdigit() or int(size) == 0 or CHUNK_SIZE % int(size):
        return Closed(
            "chunk_size",
            f"LMCache's chunk of {CHUNK_SIZE} tokens is not a multiple of {flag} {size} "
            "(engine_config.extra_args); use a size that divides it (16, 32, 64, ...)",
        )
    return None


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value `args` give `flag` (whole or abbreviated), if any."""
    for index, arg in enumerate(args):
        if not sets([arg], flag):
            continue
        if "=" in arg:
            return arg.split("=", 1)[1]
        if index + 1 < len(args):
            return args[index + 1]
    return None


def hash_seed(deployment: str, revision: int) -> str:
    """The `PYTHONHASHSEED` of a deployment revision's engines and servers: fixed, so an
    engine started again builds the same chunk keys; apart across revisions."""
    digest = hashlib.sha256(f"capyctl-lmcache\0{deployment}\0{revision}".encode()).digest()
    return str(int.from_bytes(digest[:4], "big"))


@dataclass(frozen=True)
class ServerPorts:
    zmq: int
    http: int
    metrics: int


def server_argv(install: EngineProfile, ports: ServerPorts, pool_bytes: int) -> list[str]:
    """The private server of one instance: loopback only, every port leased (several on one
    host would collide on the defaults), the pool pinned at its size."""
    return [
        str(install.executable),
        "-m",
        SERVER_MODULE,
        "--host",
        ENGINE_HOST,
        "--port",
        str(ports.zmq),
        "--http-host",
        ENGINE_HOST,
        "--http-port",
        str(ports.http),
        "--prometheus-port",
        str(ports.metrics),
        "--l1-size-gb",
        _gib(pool_bytes),
        "--eviction-policy",
        "LRU",
        "--chunk-size",
        str(CHUNK_SIZE),
        "--max-workers",
        "1",
    ]


def server_env(seed: str, gpu_uuid: str) -> dict[str, str]:
    """The server's own variables: nothing reported off the host, the engine's seed, and
    only the instance's GPU (its CUDA context goes on every GPU it sees)."""
    return {
        "DO_NOT_TRACK": "1",
        "LMCACHE_TRACK_USAGE": "false",
        "PYTHONHASHSEED": seed,
        "CUDA_VISIBLE_DEVICES": gpu_uuid,
    }


def engine_wiring(
    family: Family, ports: ServerPorts, seed: str, runtime_dir: Path
) -> tuple[list[str], dict[str, str]]:
    """The arguments and variables that connect an engine to its server (its connector
    reports no usage either). SGLang's file is written into `runtime_dir` here."""
    env = {"PYTHONHASHSEED": seed, "LMCACHE_TRACK_USAGE": "false"}
    if family == Family.VLLM:
        config = {
            "kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": VLLM_CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": f"tcp://{ENGINE_HOST}",
                "lmcache.mp.port": ports.zmq,
                "lmcache.mp.autostart": False,
            },
        }
        return ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))], env
    if family == Family.SGLANG:
        file = runtime_dir / SGLANG_CONFIG
        file.write_text(f"mp_host: {ENGINE_HOST}\nmp_port: {ports.zmq}\n", encoding="utf-8")
        return ["--enable-lmcache", "--lmcache-config-file", str(file)], {
            **env,
            "LMCACHE_CONFIG_FILE": str(file),
        }
    raise ValueError(f"{family} has no LMCache connector")


def _gib(size: int) -> str:
    return f"{size / GiB:.3f}".rstrip("0").rstrip(".")
