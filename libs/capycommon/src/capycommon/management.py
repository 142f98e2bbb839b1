"""The management API's wire: the body of every request and answer, and the error body.

The scheduler answers with these models and `capyctl` reads the answers into them. What we
send (`Request`) forbids unknown fields, so a misspelt field is refused by name; what we read
from the peer (`Answer`) ignores the fields it does not know, so a newer scheduler's
additions never break an older CLI.

Every answer, errors included, carries `api_version`. A mutation answers 202 with its
receipt; a failure answers its code's HTTP status with `ErrorBody`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    model_serializer,
)

API_VERSION = "1"
PREFIX = "/management/v1"

# A JSON object as a person wrote it: a deployment document, an error's details.
JsonObject = dict[str, JsonValue]
Action = Literal["start", "park", "stop", "delete"]
Change = Literal["created", "updated", "unchanged"]


class Request(BaseModel):
    """A body we send: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class Answer(BaseModel):
    """A body we read from the peer: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")


class Versioned(Answer):
    """A whole answer (not a part of one): it names the API's version."""

    api_version: str = API_VERSION


# Requests.


class DeployRequest(Request):
    """POST /deployments. The document is checked by the scheduler against the deployment
    schema (`capycommon.deployments`), so its errors name the document's own fields."""

    document: JsonObject
    expected_revision: int | None = None


class ActionRequest(Request):
    """POST /deployments/{name}/actions."""

    action: Action


class DrainRequest(Request):
    """POST /hosts/{host}/drain: nothing to say."""


class PullRequest(Request):
    """POST /models/pull: download a model from the Hub into a host's store ahead of time.
    `revision` is a pinned 40-hex commit (the CLI resolves a branch or tag first)."""

    repo: str
    revision: str
    files: list[str] = []
    # The host to download on; may be left out where the role has one host.
    host: str | None = None


class RemoveRequest(Request):
    """POST /models/remove: remove a download from a host's store (`name` as list models
    shows it)."""

    name: str
    host: str | None = None


class InvitationRequest(Request):
    """POST /host-invitations: invite a host to join (a server only)."""

    host_name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    # Seconds the invitation may wait; none: the server's enrollment.invitation_ttl.
    lifetime_seconds: int | None = Field(default=None, ge=1, le=3600)
    # Give a revoked host back its id with a new certificate.
    recover: bool = False


class RevokeRequest(Request):
    """POST /hosts/{host}/revoke: nothing to say."""


# Errors.


class ErrorDetail(Answer):
    code: str
    message: str
    retryable: bool
    details: JsonObject = {}


class ErrorBody(Versioned):
    """What every failure answers, with the code's HTTP status (`capycommon.errors`)."""

    error: ErrorDetail


# Mutations: a receipt each.


class Health(Versioned):
    """GET /health."""

    status: str
    version: str


class DeployAnswer(Versioned):
    """A declared deployment: its revision, and whether the document changed it."""

    operation_id: str
    deployment: str
    revision: int
    digest: str
    change: Change


class ActionAnswer(Versioned):
    operation_id: str
    deployment: str
    revision: int
    action: Action


class DrainAnswer(Versioned):
    """The deployments whose engines the drain stops. A joined host also takes no new model
    until undrained (`drained`); a standalone role's own host stays open."""

    operation_id: str
    host: str
    stopping: list[str]
    drained: bool = False


class UndrainAnswer(Versioned):
    """POST /hosts/{host}/undrain: the host takes models again (`changed`: it was drained)."""

    operation_id: str
    host: str
    changed: bool


# Deployments.


class DeploymentSummary(Answer):
    """A row of `list deployments`: NAME, STATE, READY, REVISION, HOSTS."""

    name: str
    # The instance's state, or why there is none (idle, pending, stopped, failed, ...).
    state: str
    ready: str
    revision: int
    hosts: list[str]
    routes: list[str]
    # The GPUs its instance runs on (gpu0, gpu1, ...); empty while none runs.
    gpus: list[str] = []


class DeploymentList(Versioned):
    """GET /deployments."""

    deployments: list[DeploymentSummary]


class InstanceView(Answer):
    index: int
    host: str
    gpu: str | None
    state: str
    since: float
    generation: int
    revision: int
    residency: str | None
    port: int | None
    last_error: str | None


class Charge(Answer):
    """One memory domain's charge for the deployment, its phase and where the figure came
    from (declared, measured, derived, or unsized)."""

    host: str
    domain: str
    phase: str | None
    bytes: int
    provenance: str


class Startup(Answer):
    """The startup peak on the GPU the instance runs on (else the first that could take it)."""

    host: str
    gpu: str
    device_bytes: int | None
    device_provenance: str
    host_bytes: int | None
    host_provenance: str


class BindingError(Answer):
    code: str
    message: str


class Binding(Answer):
    """The deployment as one host would run it, or why that host cannot. A field left unset
    (one that does not apply) is absent from the JSON, not null."""

    host: str
    error: BindingError | None = None
    engine: str | None = None
    model_path: str | None = None
    weights_bytes: int | None = None
    residency: str | None = None
    residency_reason: str | None = None
    # "on: LMCache 0.5.6 (lmcache), a 4 GiB pool", or "off: <why> [<gate>]".
    lmcache: str | None = None
    deep_park: bool | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: SerializerFunctionWrapHandler) -> JsonObject:
        dumped: JsonObject = handler(self)
        return {key: value for key, value in dumped.items() if key in self.model_fields_set}


class Operation(Answer):
    """The last thing done to the deployment, or why nothing could be."""

    kind: str
    reason: str
    at: float
    operation_id: str | None = None


class InFlight(Answer):
    """The one effect sent to a host and not yet seen done."""

    kind: str
    host: str
    gpu: str
    generation: int
    sent_at: float
    from_state: str | None = None
    from_generation: int | None = None
    then: str | None = None
    reason: str = ""


class Attempts(Answer):
    """Failed starts in a row; `failed` once the retries are spent."""

    count: int
    next_at: float | None
    last_error: str | None
    failed: bool
    counted_generation: int


class Requests(Answer):
    """The routers' places on the current generation, how its cut requests settle, and the
    engine's own count."""

    running: int
    settle_when_idle: int
    settle_at_stop: int
    engine_running: int
    engine_waiting: int


class IdleStep(Answer):
    # release: the LMCache server a restart_only park kept stops.
    action: Literal["park", "stop", "release"]
    at: float


class Idle(Answer):
    """The idle timeouts in force (None: never), and the next idle step if one is due."""

    ready_idle_timeout: float | None
    parked_idle_timeout: float | None
    protected: bool
    next: IdleStep | None


class Refusal(Answer):
    """A demand that can never be met as things are, with its code."""

    code: str
    message: str
    at: float


class Download(Answer):
    host: str
    repo: str
    commit: str
    done_bytes: int
    total_bytes: int
    rate: float  # bytes a second


class DeploymentStatus(DeploymentSummary, Versioned):
    """GET /deployments/{name}: everything `status deployment NAME` shows."""

    activation: str
    digest: str
    stopped: bool
    instances: list[InstanceView]
    charges: list[Charge]
    startup: Startup | None
    bindings: list[Binding]
    last_operation: Operation | None
    in_flight: InFlight | None
    attempts: Attempts
    requests: Requests
    idle: Idle
    refusal: Refusal | None
    demanded_since: float | None
    # The model's download from the Hub while one is under way, on the host it runs on.
    download: Download | None = None
    # Why its generation runs where it does: the GPU set chosen and what placement weighed.
    placed: str | None = None
    # The deployment document in its canonical form.
    document: JsonObject


# Hosts and engines.


class HostGpu(Answer):
    name: str
    uuid: str
    total: int
    used: int
    free: int
    unified: bool


class HostDomain(Answer):
    """A memory domain: its size, limits, and what the deployments on it are charged."""

    name: str
    capacity: int
    managed_limit: int
    free_reserve: int
    parked_limit: int
    charged: int


class HostRow(Answer):
    name: str
    # ready, unobserved (alive, no memory reading yet) or down; a joined host also unreachable
    # (its heartbeat lapsed: nothing is sent there) or revoked.
    state: str
    gpus: list[HostGpu]
    domains: list[HostDomain]
    # A host that joined the server (none of these for a standalone role's own host).
    joined: bool = False
    host_id: str | None = None
    version: str | None = None
    connected: bool = False
    last_heartbeat: float | None = None
    engines: list[str] = []
    revoked: bool = False
    certificate_expires: float | None = None
    # Drained by an operator: it takes no new model until undrained.
    drained: bool = False
    unreachable_since: float | None = None
    # What its release can do (`capycommon.domain.hosts.HOST_CAPABILITIES`): the server
    # gives it only the work whose capabilities it names.
    capabilities: list[str] = []


class InvitationAnswer(Versioned):
    """A join file's content: the host's operator gives it to `capyctl join host`."""

    join: JsonObject


class RevokeAnswer(Versioned):
    host_id: str
    name: str
    revoked: bool
    newly_revoked: bool


class HostList(Versioned):
    """GET /hosts."""

    hosts: list[HostRow]


class EngineRow(Answer):
    """An engine profile a host has published."""

    host: str
    name: str
    family: str
    version: str
    executable: str
    install_path: str
    fingerprint: str
    verified: bool
    added_at: datetime


class ModelRow(Answer):
    """A model on a host: a folder or file under its models root, or a download from the Hub
    in its store, and the deployments that name it."""

    host: str
    name: str  # as a deployment names it (for a download: its store under the models root)
    path: str
    kind: str
    weights_bytes: int | None
    # For a download from the Hub: the repository and the commit.
    repo: str | None = None
    commit: str | None = None
    used_by: list[str]


class EngineLog(Versioned):
    """GET /deployments/{name}/engine-log: the last lines of its engine's log, from the host
    that runs it: `kept` says where the log is (file; memory, for retention: zero; none)."""

    deployment: str
    host: str
    kept: Literal["file", "memory", "none"]
    lines: list[str]
    launch_id: str | None = None
    note: str | None = None


class StoreOperationAnswer(Versioned):
    """A pull or removal in a host's model store: POST /models/pull and /models/remove answer
    it as sent, GET /hosts/{host}/store-operations/{operation} as it goes."""

    operation_id: str
    host: str
    # sent (hostd has not begun it: its kind and name are empty when read back), running,
    # done, failed
    state: str
    kind: str  # pull or remove
    name: str  # the store's path under the models root
    download: Download | None = None
    # How a failed one failed.
    code: str | None = None
    message: str | None = None


class ModelList(Versioned):
    """GET /models."""

    models: list[ModelRow]


class EngineList(Versioned):
    """GET /engines."""

    engines: list[EngineRow]
