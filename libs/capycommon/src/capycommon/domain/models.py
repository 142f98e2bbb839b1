"""Models on a host: what hostd found at each model path, and what the files say."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from capycommon.domain.commands import HubPull

# The weights an engine loads, by format, in order of preference: a checkpoint that ships
# both safetensors and .bin loads only the safetensors, so only one format counts.
WEIGHT_FORMATS = ((".safetensors",), (".gguf",), (".bin", ".pt"))


WEIGHT_SUFFIXES = frozenset(suffix for formats in WEIGHT_FORMATS for suffix in formats)


ModelKind = Literal["folder", "file", "missing", "other", "no_home"]


class QuantizationConfig(BaseModel):
    """A checkpoint's quantization as one of its config files states it: `config.json`'s
    `quantization_config`, or NVIDIA ModelOpt's `hf_quant_config.json` (`quantization`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    file: Literal["config.json", "hf_quant_config.json"]
    quant_method: str = ""
    quant_algo: str = ""


class DecisionHead(BaseModel):
    """A decision model's head, as its files declare it: SGLang's decision checkpoint
    (`decision_config.json`), a joint-schema head (`joint_head_config.json` and
    `joint_head.safetensors`), or a GGUF's `<architecture>.decision.type`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: Literal["decision_config", "joint_head", "gguf"]
    # Where it says so: `<folder>/decision_config.json`, `<file>: clef.decision.type clef`.
    evidence: str
    # The GGUF's decision type (clef, laya, kev, ...); None for a folder's head.
    type: str | None = None


class ModelFacts(BaseModel):
    """One model path on a host: what is there, and what its config files say."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    # Where it is on the host, as an engine is given it.
    path: str
    # A folder, a single file, nothing (missing), something else (a device, a socket), or
    # a `~user/...` path whose user has no home folder there.
    kind: ModelKind
    # Bytes of the weights an engine loads (one format of WEIGHT_FORMATS); None if none.
    weights_bytes: int | None = None
    # From config.json: `architectures`, and `dtype` (or the older `torch_dtype`).
    architectures: tuple[str, ...] = ()
    dtype: str | None = None
    quantization: tuple[QuantizationConfig, ...] = ()
    # From config.json (or its `text_config`): the attention heads and key-value heads, which
    # an engine's tensor-parallel size must divide; None where it does not say.
    attention_heads: int | None = Field(default=None, ge=1)
    kv_heads: int | None = Field(default=None, ge=1)
    # The decision head its files declare; None for any other model.
    decision: DecisionHead | None = None


def weights_of(files: Iterable[tuple[str, int]]) -> int | None:
    """Bytes of the weights among `files` (name, size), counting one format of WEIGHT_FORMATS
    (the first present); None if none."""
    totals: dict[int, int] = {}
    for name, size in files:
        kind = next((i for i, fmt in enumerate(WEIGHT_FORMATS) if name.endswith(fmt)), None)
        if kind is not None:
            totals[kind] = totals.get(kind, 0) + size
    return totals[min(totals)] if totals else None


class HostModels(BaseModel):
    """A host's models: those under its models root by name, and the paths it was asked to
    describe, each under the path as the deployment writes it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    models_root: str
    models: dict[str, ModelFacts] = Field(default_factory=dict)
    described: dict[str, ModelFacts] = Field(default_factory=dict)
    # The Hub sources of described stores not downloaded yet, by path: their facts are what
    # the Hub's file listing says (the weights' size), until the download.
    sources: dict[str, HubPull] = Field(default_factory=dict)

    def find(self, written: str) -> ModelFacts | None:
        """The facts of a deployment's `model` path; None until the host has described it."""
        if under_root(written):
            found = self.models.get(str(PurePosixPath(written)))
            if found is not None:
                return found
        return self.described.get(written)

    def listed(self, written: str) -> bool:
        """Whether the models root's own listing holds `written` (no describing needed)."""
        return under_root(written) and str(PurePosixPath(written)) in self.models


def under_root(written: str) -> bool:
    """A model path that names something under the models root (not `/...` nor `~...`)."""
    return not written.startswith(("/", "~"))
