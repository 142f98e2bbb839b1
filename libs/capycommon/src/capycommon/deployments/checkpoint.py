"""What a model's config files say about its weights' quantization, from the host's facts.

Judged the way SGLang reads them: `config.json`'s `quantization_config` (`quant_method`
`modelopt` with a `quant_algo`, or `modelopt_fp4`), else NVIDIA ModelOpt's
`hf_quant_config.json` (`quantization.quant_algo`). A quant_algo naming FP4 (`NVFP4`,
`NVFP4_AWQ`, `W4A8_NVFP4_FP8`, ...) is a ModelOpt FP4 checkpoint. hostd reads the files
(`capycommon.state.hostfacts`); files that were missing, unreadable or not the expected JSON say
nothing: an engine will judge them itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from capycommon.domain.models import ModelFacts
from capycommon.engines.launch import MODELOPT_FP4


@dataclass(frozen=True)
class Quantization:
    kind: str
    # Where the folder says so: `<folder>/hf_quant_config.json: quantization.quant_algo NVFP4`.
    evidence: str


def quantization(model: ModelFacts) -> Quantization | None:
    """The quantization a model folder declares, when CapyCTL must know it; else None."""
    if model.kind != "folder":
        return None
    for stated in model.quantization:
        algo = stated.quant_algo
        if stated.file == "config.json":
            method = stated.quant_method.lower()
            if method == MODELOPT_FP4 or (method == "modelopt" and "FP4" in algo.upper()):
                shown = f", quant_algo {algo}" if algo else ""
                return Quantization(
                    MODELOPT_FP4,
                    f"{model.path}/config.json: quantization_config.quant_method {method}{shown}",
                )
        elif "FP4" in algo.upper():
            return Quantization(
                MODELOPT_FP4, f"{model.path}/hf_quant_config.json: quantization.quant_algo {algo}"
            )
    return None
