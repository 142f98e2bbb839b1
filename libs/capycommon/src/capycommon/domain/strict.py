"""The base of internal models and documents."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Internal models and documents forbid unknown fields: a typo fails, naming the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)
