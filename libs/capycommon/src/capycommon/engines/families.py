"""The engine families CapyCTL drives, and which of their versions it supports and verified."""

from __future__ import annotations

from enum import StrEnum

from packaging.version import InvalidVersion, Version

from capycommon.errors import EngineUnsupported


class Family(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    # TensorFold's CLI is not public: `engines.tensorfold` holds what CapyCTL assumes of it.
    TENSORFOLD = "tensorfold"
    # Any OpenAI-compatible server, started from the command its registration gives
    # (`engines.custom`).
    CUSTOM = "custom"
    # Not an engine: LMCache's KV cache server, registered like one (`engines.lmcache`).
    LMCACHE = "lmcache"


PYTHON_FAMILIES = (Family.VLLM, Family.SGLANG, Family.LMCACHE)
# The families a deployment may run on.
ENGINE_FAMILIES = (Family.VLLM, Family.SGLANG, Family.LLAMACPP, Family.TENSORFOLD, Family.CUSTOM)
# The families whose load CapyCTL cannot read from the engine (no metrics it knows): a request
# cut short on them settles at the engine's next stop, and a router's places alone say they
# are busy.
LOAD_UNREAD = frozenset({Family.TENSORFOLD, Family.CUSTOM})
# The families whose memory CapyCTL cannot derive: a deployment states it (`resources`).
EXPLICIT_RESOURCES = LOAD_UNREAD

# The oldest version of each family CapyCTL can drive, and why.
MINIMUM: dict[Family, tuple[str, str]] = {
    # 0.11: the V1 engine, sleep levels, the nested OpenAI error envelope.
    Family.VLLM: ("0.11.0", "sleep mode and the V1 engine"),
    # 0.5: release/resume memory occupation with tags.
    Family.SGLANG: ("0.5.0", "release and resume of memory with tags"),
    # b5000 (spring 2025): /health with the loading state and the OpenAI chat routes.
    Family.LLAMACPP: ("5000", "the loading state on /health"),
    # 0.6: the `serve` command and the memory limit variable CapyCTL assumes.
    Family.TENSORFOLD: ("0.6.0", "the serve command and TENSORFOLD_CUDA_MEMORY_LIMIT_GB"),
    # 0.5.6: the multi-process server this release qualifies.
    Family.LMCACHE: ("0.5.6", "the multi-process server CapyCTL runs per instance"),
}
# The first version of a family CapyCTL does not drive yet, and why.
BEYOND: dict[Family, tuple[str, str]] = {
    Family.LMCACHE: ("0.6", "LMCache 0.5.6 or a later 0.5.x"),
}

# Versions whose behaviour CapyCTL was checked against; others run as "custom".
VERIFIED: dict[Family, frozenset[str]] = {
    Family.VLLM: frozenset({"0.28.0", "0.29.0", "0.32.0"}),
    Family.SGLANG: frozenset({"0.5.15", "0.5.16", "0.5.22"}),
    Family.LLAMACPP: frozenset(),  # builds change daily: always custom
    Family.TENSORFOLD: frozenset(),  # never checked against the real engine
    Family.CUSTOM: frozenset(),
    Family.LMCACHE: frozenset({"0.5.6", "0.5.7"}),
}


def parse_version(family: Family, version: str) -> Version:
    try:
        return Version(version)
    except InvalidVersion:
        raise EngineUnsupported(
            f"{family} reports version {version!r}, which is not a version number"
        ) from None


def check_supported(family: Family, version: str) -> None:
    """Refuse a version older than the family's minimum (a custom engine has none)."""
    if family not in MINIMUM:
        return
    minimum, why = MINIMUM[family]
    parsed = parse_version(family, version)
    if parsed < Version(minimum):
        raise EngineUnsupported(
            f"{family} {version} is older than {minimum}, the first with {why}; upgrade the engine"
        )
    if family in BEYOND and parsed >= Version(BEYOND[family][0]):
        first, runs = BEYOND[family]
        raise EngineUnsupported(
            f"{family} {version} is {first} or later, which this release does not run; it runs "
            f"{runs}"
        )


def is_verified(family: Family, version: str) -> bool:
    return version in VERIFIED[family]
