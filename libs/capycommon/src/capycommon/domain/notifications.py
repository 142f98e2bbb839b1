"""Notifications: a pub/sub message telling subscribers a record changed."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError


class Notification(BaseModel):
    """Tells subscribers to re-read `kind` `id`; `version` lets them skip what they have."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: str
    id: str
    version: int


def announces(data: object, kind: str) -> bool:
    """Whether a pub/sub message's `data` is a notification of `kind` (not, say, a subscribe
    confirmation's count, or another kind's notification)."""
    if not isinstance(data, bytes | str):
        return False
    try:
        return Notification.model_validate_json(data).kind == kind
    except ValidationError:
        return False
