"""What a model folder's config files say about its weights' quantization.

Read the way SGLang reads them: `config.json`'s `quantization_config` (`quant_method`
`modelopt` with a `quant_algo`, or `modelopt_fp4`), else NVIDIA ModelOpt's
`hf_quant_config.json` (`quantization.quant_algo`). A quant_algo naming FP4 (`NVFP4`,
`NVFP4_AWQ`, `W4A8_NVFP4_FP8`, ...) is a ModelOpt FP4 checkpoint. Files that are missing,
unreadable or not the expected JSON say nothing: an engine will judge them itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capycommon.engines.launch import MODELOPT_FP4

# The largest config file read (they are a few KiB; anything bigger is not one).
MAX_CONFIG_BYTES = 4 << 20


@dataclass(frozen=True)
class Quantization:
    kind: str
    # Where the folder says so: `<folder>/hf_quant_config.json: quantization.quant_algo NVFP4`.
    evidence: str


def quantization(model: Path) -> Quantization | None:
    """The quantization a model folder declares, when CapyCTL must know it; else None."""
    if not model.is_dir():
        return None
    config = _json(model / "config.json")
    declared = config.get("quantization_config") if config else None
    if isinstance(declared, dict):
        method = str(declared.get("quant_method", "")).lower()
        algo = str(declared.get("quant_algo", ""))
        if method == MODELOPT_FP4 or (method == "modelopt" and "FP4" in algo.upper()):
            shown = f", quant_algo {algo}" if algo else ""
            return Quantization(
                MODELOPT_FP4,
                f"{model / 'config.json'}: quantization_config.quant_method {method}{shown}",
            )
    exported = _json(model / "hf_quant_config.json")
    if exported:
        section = exported.get("quantization", exported)
        algo = str(section.get("quant_algo", "")) if isinstance(section, dict) else ""
        if "FP4" in algo.upper():
            return Quantization(
                MODELOPT_FP4, f"{model / 'hf_quant_config.json'}: quantization.quant_algo {algo}"
            )
    return None


def _json(path: Path) -> dict[str, Any] | None:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return None
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return found if isinstance(found, dict) else None
