"""How the simulator's request bodies take a key they do not know: kept (`Tolerant`, as the
engines' OpenAI-style request models allow extra fields), or refused (`Strict`, where a
misspelled key would ask something else: inside a decision's question, a different question)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Tolerant(BaseModel):
    model_config = ConfigDict(extra="allow")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
