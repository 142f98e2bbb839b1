"""Pub/sub notifications: they carry only what changed, never the state itself."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Notification(BaseModel):
    """Tells subscribers to re-read `kind` `id`; `version` lets them skip what they have."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: str
    id: str
    version: int
