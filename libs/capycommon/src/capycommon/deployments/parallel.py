"""Tensor parallelism: whether a deployment may span the GPUs it asks for on a host.

A model spans the GPUs of one host only; a model across machines is out of scope. The rules
are the engines' own, checked before anything starts so a refusal names the fix:
- vLLM and SGLang split the attention heads over the ranks: the size must divide
  `num_attention_heads` (vLLM `ModelConfig.verify_with_parallel_config`: "Total number of
  attention heads (H) must be divisible by tensor parallel size (N)"; SGLang asserts the
  same in its attention layers). The key-value heads are split too, or replicated when
  there are fewer of them than ranks: the size must divide them, or they it (vLLM's and
  SGLang's `QKVParallelLinear`, through `divide`).
- llama.cpp splits layers over every visible device (`--split-mode layer`): any count runs.
- TensorFold and custom engines are run on one GPU: CapyCTL knows no flag of theirs for more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from capycommon.domain.deployment import Deployment
from capycommon.domain.models import ModelFacts
from capycommon.engines.families import Family
from capycommon.engines.registry import EngineProfile
from capycommon.errors import (
    InvalidConfig,
    MultiGpuUnsupported,
    NotEnoughGpus,
    TensorParallelInvalid,
)

if TYPE_CHECKING:
    from capycommon.deployments.resolve import HostFacts

# The families that span GPUs, each with the flag CapyCTL sets for it.
SPANS = {
    Family.VLLM: "--tensor-parallel-size",
    Family.SGLANG: "--tp-size",
    Family.LLAMACPP: "--split-mode layer --tensor-split",
}
# The families whose ranks split attention heads.
SPLITS_HEADS = frozenset({Family.VLLM, Family.SGLANG})


def check_parallel(
    deployment: Deployment, profile: EngineProfile, model: ModelFacts, host: HostFacts
) -> None:
    """Refuse, naming the fix, pinned GPUs the host lacks and a span this engine, this model
    or this host cannot run."""
    present = ", ".join(host.gpus) or "none"
    for index, gpu in enumerate(deployment.pinned):
        if gpu not in host.gpus:
            raise InvalidConfig(
                f"devices[{index}].id: {gpu} is not on this host (GPUs: {present}); pin GPUs "
                "it has, or drop devices"
            )
    size = deployment.gpu_count
    if size == 1:
        return
    if profile.family not in SPANS:
        raise MultiGpuUnsupported(
            f"{profile.family} engines run on one GPU in CapyCTL; drop "
            "engine_config.tensor_parallel and name at most one device"
        )
    if host.unified:
        raise MultiGpuUnsupported(
            "this host's GPU memory is one unified pool: a model spans no GPUs there; drop "
            "engine_config.tensor_parallel, or place it on a host with discrete GPUs"
        )
    if profile.family in SPLITS_HEADS:
        check_heads(size, model, profile.family)  # wrong on any host: said first
    if size > len(host.gpus):
        raise NotEnoughGpus(
            f"it spans {size} GPUs and this host has {len(host.gpus)} ({present}); lower "
            f"engine_config.tensor_parallel, or place it on a host with {size} GPUs"
        )


def check_heads(size: int, model: ModelFacts, family: Family) -> None:
    """The engine's own rule: the size divides the attention heads, and divides the key-value
    heads or is a multiple of them. Unknown counts (no config.json) are left to the engine."""
    heads, kv = model.attention_heads, model.kv_heads
    if heads is not None and heads % size:
        raise TensorParallelInvalid(
            f"engine_config.tensor_parallel: {family} splits the model's {heads} attention "
            f"heads over its GPUs, and {size} does not divide {heads}; use "
            f"{_divisors(heads, size)}"
        )
    if kv is not None and kv % size and size % kv:
        raise TensorParallelInvalid(
            f"engine_config.tensor_parallel: {family} splits (or replicates) the model's {kv} "
            f"key-value heads over its GPUs, and {size} neither divides {kv} nor is a multiple "
            f"of it; use {_divisors(kv, size)}"
        )


def _divisors(count: int, near: int) -> str:
    """The sizes that divide `count`, up to twice `near`, as a short list."""
    found = [str(n) for n in range(1, min(count, 2 * near) + 1) if count % n == 0]
    return " or ".join(found[-3:]) if found else "1"
