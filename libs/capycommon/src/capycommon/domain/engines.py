"""What an engine is asked to serve, and where a parked model's weights wait."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class Residency(StrEnum):
    """Where a parked model's weights wait (the park tier)."""

    HOST_BACKED = "host_backed"  # weights in host RAM; KV cache dropped
    DEEP = "deep"  # weights and KV cache dropped; reloaded from disk on wake
    RESTART_ONLY = "restart_only"  # never parks: stopped, later cold-started


PARKING = (Residency.HOST_BACKED, Residency.DEEP)


# What a model serves: chat (and completions, embeddings), or decisions (a decision model,
# `capycommon.engines.decisions`).
Api = Literal["chat", "decisions"]
