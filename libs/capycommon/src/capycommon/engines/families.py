"""The engine families CapyCTL drives, and which of their versions it supports and verified."""

from __future__ import annotations

from enum import StrEnum

from packaging.version import InvalidVersion, Version

from capycommon.errors import EngineUnsupported


class Family(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"


PYTHON_FAMILIES = (Family.VLLM, Family.SGLANG)

# The oldest version of each family CapyCTL can drive, and why.
MINIMUM: dict[Family, tuple[str, str]] = {
    # 0.11: the V1 engine, sleep levels, the nested OpenAI error envelope.
    Family.VLLM: ("0.11.0", "sleep mode and the V1 engine"),
    # 0.5: release/resume memory occupation with tags.
    Family.SGLANG: ("0.5.0", "release and resume of memory with tags"),
    # b5000 (spring 2025): /health with the loading state and the OpenAI chat routes.
    Family.LLAMACPP: ("5000", "the loading state on /health"),
}

# Versions whose behaviour CapyCTL was checked against; others run as "custom".
VERIFIED: dict[Family, frozenset[str]] = {
    Family.VLLM: frozenset({"0.28.0", "0.29.0", "0.32.0"}),
    Family.SGLANG: frozenset({"0.5.15", "0.5.16", "0.5.22"}),
    Family.LLAMACPP: frozenset(),  # builds change daily: always custom
}


def parse_version(family: Family, version: str) -> Version:
    try:
        return Version(version)
    except InvalidVersion:
        raise EngineUnsupported(
            f"{family} reports version {version!r}, which is not a version number"
        ) from None


def check_supported(family: Family, version: str) -> None:
    """Refuse a version older than the family's minimum."""
    minimum, why = MINIMUM[family]
    if parse_version(family, version) < Version(minimum):
        raise EngineUnsupported(
            f"{family} {version} is older than {minimum}, the first with {why}; upgrade the engine"
        )


def is_verified(family: Family, version: str) -> bool:
    return version in VERIFIED[family]
