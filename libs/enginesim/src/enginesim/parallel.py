"""Tensor parallelism as the engines size and check it: shares of bytes, the model's heads.

A tensor-parallel engine splits each layer's weights evenly over its ranks, one rank per
device, so each rank holds the weights divided by the rank count (rounded up: no byte is
left out). llama.cpp splits one process's model over its devices by the proportions of
`--tensor-split` instead. Attention is split by heads, so the model's head count must divide
by the rank count; the count is `num_attention_heads` in the model folder's config.json (or
its `text_config`, as multimodal configs nest it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def per_rank(total: int, ranks: int) -> int:
    """Each rank's share of `total` bytes split evenly over `ranks`, rounded up."""
    return -(-total // max(1, ranks))


def split_bytes(total: int, proportions: Sequence[float]) -> list[int]:
    """`total` bytes split by `proportions` (any non-negative numbers, not all zero); the
    shares sum to `total`, what rounding leaves going to the first share that is not zero."""
    weight = sum(proportions)
    if weight <= 0:
        raise ValueError("the proportions are all zero")
    shares = [int(total * part / weight) for part in proportions]
    first = next(index for index, part in enumerate(proportions) if part > 0)
    shares[first] += total - sum(shares)
    return shares


def attention_heads(model: Path) -> int | None:
    """`num_attention_heads` of the model folder's config.json; None when there is no such
    file, it does not parse, or it names no head count (the check is then skipped, as an
    engine without the count cannot make it)."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for found in (config, config.get("text_config")):
        if isinstance(found, dict):
            heads = found.get("num_attention_heads")
            if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0:
                return heads
    return None


def indivisible_heads(model: Path, ranks: int) -> int | None:
    """The model's head count when `ranks` does not divide it; None when it does or the count
    is unknown."""
    heads = attention_heads(model)
    if heads is None or heads % ranks == 0:
        return None
    return heads
