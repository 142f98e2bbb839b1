"""Notifications: a pub/sub message telling subscribers a record changed."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Notification(BaseModel):
    """Tells subscribers to re-read `kind` `id`; `version` lets them skip what they have."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: str
    id: str
    version: int
