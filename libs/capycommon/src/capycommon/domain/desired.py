"""Desired state: each declared deployment's record (its document and what the operator and
the scheduler want of it), the scheduler's choices, and the demands that ask for a model.

The scheduler alone writes deployment records; routers and the CLI read them and append
demands (`capycommon.state.desired` stores them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from capycommon.domain.deployment import Deployment
from capycommon.domain.strict import Strict

# Why the scheduler takes a serving or parked engine out (parks or stops it), one word each:
# a switch made room for another model; an idle timeout; an operator's park, stop or delete;
# an operator's drain of its host; a new revision replaces it; cut requests hold every place
# (a restart); the host's bound on parked models.
EvictionCause = Literal["switch", "idle", "operator", "drain", "revision", "restart", "max_parked"]


class Inflight(Strict):
    """The one effect in flight for a deployment's instance, until hostd's record shows it.

    `from_state` and `from_generation` are the instance as it was when the effect began, so
    the effect is done once the record moved on (or hostd refused it)."""

    kind: Literal["launch", "wake", "park", "stop", "drain"]
    host: str
    gpu: str
    generation: int
    sent_at: float
    from_state: str | None = None
    from_generation: int | None = None
    # For a drain: what follows it once the engine reads idle.
    then: Literal["park", "stop"] | None = None
    reason: str = ""
    # For a drain, park or stop that takes a serving or parked engine out: why (counted
    # once, as an eviction, when the park or stop is done).
    cause: EvictionCause | None = None


class Attempts(Strict):
    """Failed starts in a row; `failed` once the retries are spent (cleared by a start)."""

    count: int = 0
    next_at: float | None = None
    last_error: str | None = None
    failed: bool = False
    # The generation whose failure was counted last, so one failure counts once.
    counted_generation: int = 0


class Operation(Strict):
    """The last thing done to a deployment, or why nothing could be."""

    kind: str
    reason: str
    at: float
    operation_id: str | None = None


class Refusal(Strict):
    """A demand that cannot be met at all, not merely not yet (the model does not fit even
    with every model that may be evicted stopped). Routers fail the requests that were
    waiting when it was written with its code; later requests ask again."""

    code: str
    message: str
    at: float


class Victim(Strict):
    """An instance a switch released, by its deployment and generation."""

    deployment: str
    generation: int


class Switch(Strict):
    """A switch under way to this deployment: when the scheduler decided to release the first
    of its victims (to start or wake it on `gpu` of `host`), and every victim released for it
    since. It ends when the deployment is ready."""

    host: str
    gpu: str
    started_at: float
    victims: tuple[Victim, ...] = ()


class Choice(Strict):
    """One choice of the scheduler, in the control plane's events stream.

    `evicted`: a park or stop that took a serving or parked engine out is done, with its
    `cause`. `switched`: a switch ended with its deployment ready, `duration_s` after the
    scheduler decided to release its first victim, `engine_s` of it the engines' own part
    (the victims' sleep calls and stops, the deployment's load or wake calls)."""

    kind: str
    deployment: str
    reason: str
    host: str | None = None
    generation: int | None = None
    at: float
    cause: EvictionCause | None = None
    duration_s: float | None = None
    engine_s: float | None = None


class DeploymentRecord(Strict):
    """One declared deployment: its document and what the operator and the scheduler want."""

    name: str
    revision: int
    digest: str
    document: Deployment
    created_at: float
    updated_at: float
    # An operator stop: on-demand activation is suspended (requests get deployment_stopped)
    # until an operator start.
    stopped: bool = False
    # For activation: explicit, the operator's last start (ready) or park (parked).
    wanted: Literal["ready", "parked"] | None = None
    # An operator park of an on-demand deployment, for the generation it names, until a
    # demand wakes it (the wake clears it) or a start draws a new generation.
    park_requested: int | None = None
    # A drain of the host the instance of this generation runs on: stop it, stay on demand.
    stop_requested: int | None = None
    deleting: bool = False
    # The last generation drawn; each activation draws the next.
    generation: int = 0
    # The host that generation was placed on, by the scheduler's own choice: no other
    # host's record of it is believed (`capycommon.state.ownership`). None for a record
    # written before placements were kept, until its next activation.
    host: str | None = None
    # Why that generation went where it did: its GPUs and what placement weighed (`capyctl
    # status deployment` shows it). None before its first start.
    placed: str | None = Field(default=None, max_length=2000)
    inflight: Inflight | None = None
    attempts: Attempts = Attempts()
    last_operation: Operation | None = None
    refusal: Refusal | None = None
    # A switch under way to this deployment, until it is ready.
    switch: Switch | None = None
    version: int = 0

    @property
    def activation(self) -> str:
        return self.document.lifecycle.activation


class Demand(Strict):
    """A model is wanted: a request waits for it, or an operator started it. With `restart`,
    its instance of that generation must be stopped first: cut requests hold every place."""

    deployment: str
    source: str
    at: float
    restart: int | None = None
