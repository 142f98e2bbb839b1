"""What the management API does: declare deployments, act on them, drain hosts.

Each operation on deployments writes desired state (deployment records, demands) and wakes
the planning loop; the loop does the rest. The model store's pulls and removals are the
exception: they are sent to the host's hostd as commands, and read back from its records.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from capycommon.deployments import (
    Deployment,
    check_routes,
    parse_deployment,
    revision_digest,
)
from capycommon.deployments.resolve import HUB_STORE, hub_origin, named_path
from capycommon.domain import hosts as host_records
from capycommon.domain.commands import HubPull, Pull, Remove
from capycommon.domain.desired import Attempts, DeploymentRecord, Operation
from capycommon.domain.instances import LIVE_STATES, InstanceState
from capycommon.domain.models import HostModels
from capycommon.errors import (
    AgentUnreachable,
    HostUnreachable,
    InvalidConfig,
    InvalidRequest,
    LifecycleConflict,
    ModelInUse,
    NotFound,
    RevisionConflict,
)
from capycommon.hub.source import HubSource
from capycommon.management import (
    Action,
    ActionAnswer,
    Change,
    DeployAnswer,
    DeploymentStatus,
    DeploymentSummary,
    Download,
    DrainAnswer,
    EngineLog,
    EngineRow,
    HostRow,
    JsonObject,
    ModelRow,
    PullRequest,
    RemoveRequest,
    StoreOperationAnswer,
    UndrainAnswer,
)
from capycommon.state.desired import DeploymentStore
from capycommon.state.stores import State
from capyctl_scheduler import status
from capyctl_scheduler.loop import Scheduler
from capyctl_scheduler.snapshot import Snapshot

S = InstanceState
_DOWNLOAD_FIELDS = {"repo", "commit", "done_bytes", "total_bytes", "rate"}


def operation_id() -> str:
    return f"op-{int(time.time() * 1000):x}-{secrets.token_hex(4)}"


# How long the engine-log route waits for hostd's answer.
ENGINE_LOG_WAIT_S = 5.0


@dataclass
class Manager:
    scheduler: Scheduler

    @property
    def state(self) -> State:
        return self.scheduler.state

    @property
    def store(self) -> DeploymentStore:
        return self.state.deployments

    async def snapshot(self) -> Snapshot:
        return await self.scheduler.observer.snapshot(self.scheduler.demands.oldest())

    async def deploy(self, document: JsonObject, expected_revision: int | None) -> DeployAnswer:
        """Declare a deployment or a new revision of one; an equal document changes nothing."""
        deployment = parse_deployment(document, "request body")
        existing = await self.store.all()
        current = existing.get(deployment.name)
        others = [r.document for n, r in existing.items() if n != deployment.name]
        check_routes([*others, deployment])
        _check_declarable(deployment.name, current, expected_revision)
        await self._check_runnable(deployment)
        digest = revision_digest(deployment)
        op = operation_id()
        change: Change
        if current is not None and current.digest == digest:
            change = "unchanged"
            record = current
        else:
            change = "created" if current is None else "updated"
            record = await self.store.put(_revised(current, deployment, digest, change, op))
            self.scheduler.wake.set()
        return DeployAnswer(
            operation_id=op,
            deployment=record.name,
            revision=record.revision,
            digest=record.digest,
            change=change,
        )

    async def _check_runnable(self, deployment: Deployment) -> None:
        """Refuse a document no host can run (its engine, its model, its park tier), naming
        the first host's reason; hosts not yet observed are not asked."""
        record = DeploymentRecord(
            name=deployment.name,
            revision=0,
            digest="",
            document=deployment,
            created_at=0.0,
            updated_at=0.0,
        )
        bindings = await self.scheduler.observer.bindings_of(record)
        errors = [b.error for b in bindings.values() if b.error is not None]
        if errors and len(errors) == len(bindings):
            raise errors[0].retold(errors[0].message)

    async def act(self, name: str, verb: Action) -> ActionAnswer:
        record = await self._get(name)
        if record.deleting and verb == "delete":
            return ActionAnswer(
                operation_id=operation_id(), deployment=name, revision=record.revision, action=verb
            )
        if record.deleting:
            raise LifecycleConflict(f"deployment {name!r} is being deleted")
        snap = await self.snapshot()
        instance = snap.instances.get(name)
        now = time.time()
        op = operation_id()
        update: dict[str, Any] = {}
        if verb == "start":
            update = {"stopped": False, "stop_requested": None, "park_requested": None}
            if record.attempts.failed:
                update["attempts"] = Attempts()
            if record.activation == "explicit":
                update["wanted"] = "ready"
            else:
                await self.state.demands.ask(name, "operator")
        elif verb == "park":
            # A restart_only model parks by stopping (a "restart_only park"): the deployment
            # reads parked and the next request cold-starts it.
            if record.activation == "explicit":
                update["wanted"] = "parked"
            elif instance is None or instance.state not in (S.READY, S.PARKED):
                state = instance.state if instance else "not running"
                raise LifecycleConflict(
                    f"deployment {name!r} is {state}: only a ready model parks; start it first"
                )
            else:
                update["park_requested"] = instance.generation
        elif verb == "stop":
            update = {"stopped": True, "wanted": None, "park_requested": None}
        else:
            update = {"deleting": True}
        update["last_operation"] = Operation(
            kind=verb, reason=f"operator {verb}", at=now, operation_id=op
        )
        written = await self.store.put(record.model_copy(update=update))
        self.scheduler.wake.set()
        return ActionAnswer(
            operation_id=op, deployment=name, revision=written.revision, action=verb
        )

    async def drain(self, host: str) -> DrainAnswer:
        """Stop every engine on a host; the deployments stay on demand. Where the role has
        other hosts (a joined host, or a server's embedded host beside joined ones), the host
        also takes no new model until undrained, so its models move to the others as requests
        come; a standalone role's only host has nowhere else to send them and stays open."""
        snap = await self.snapshot()
        if host not in snap.hosts:
            raise _no_host(host)
        drained = snap.hosts[host].joined or len(snap.hosts) > 1
        if drained:
            await self.state.host_marks.set_drained(host, True)
        stopping = []
        for name, instance in snap.instances.items():
            if instance.host != host or instance.state not in LIVE_STATES:
                continue
            record = snap.deployments[name]
            await self.store.put(
                record.model_copy(
                    update={
                        "stop_requested": instance.generation,
                        "park_requested": None,
                        "last_operation": Operation(
                            kind="drain", reason=f"host {host} drained", at=time.time()
                        ),
                    }
                )
            )
            stopping.append(name)
        self.scheduler.wake.set()
        return DrainAnswer(
            operation_id=operation_id(), host=host, stopping=sorted(stopping), drained=drained
        )

    async def undrain(self, host: str) -> UndrainAnswer:
        """Let a drained host take models again."""
        snap = await self.snapshot()
        if host not in snap.hosts:
            raise _no_host(host)
        changed = await self.state.host_marks.set_drained(host, False)
        self.scheduler.wake.set()
        return UndrainAnswer(operation_id=operation_id(), host=host, changed=changed)

    async def status(self, name: str) -> DeploymentStatus:
        await self._get(name)
        snap = await self.snapshot()
        if name not in snap.deployments:
            raise NotFound(f"no deployment named {name!r}")
        detail = status.detail(snap, name)
        instance = snap.instances.get(name)
        if instance is None or instance.state != S.STARTING:
            return detail
        found = await self.state.downloads.get(instance.host, name)
        if found is None:
            return detail
        download = _download(instance.host, found)
        return detail.model_copy(update={"download": download})

    async def summaries(self) -> list[DeploymentSummary]:
        snap = await self.snapshot()
        return [status.summary(snap, name) for name in sorted(snap.deployments)]

    async def hosts(self) -> list[HostRow]:
        snap = await self.snapshot()
        readings = {host: await self.state.memory.reading(host) for host in snap.hosts}
        return status.host_rows(snap, readings)

    async def engines(self) -> list[EngineRow]:
        rows = []
        for host in sorted(self.scheduler.observer.hosts):
            published = await self.scheduler.observer.engines(host)
            for profile in published.profiles if published else []:
                rows.append(
                    EngineRow(
                        host=host,
                        name=profile.name,
                        family=str(profile.family),
                        version=profile.version,
                        executable=str(profile.executable),
                        install_path=str(profile.install_path),
                        fingerprint=profile.fingerprint,
                        verified=profile.verified,
                        added_at=profile.added_at,
                    )
                )
        return rows

    async def models(self, host: str | None) -> list[ModelRow]:
        """Each host's models (or `host`'s), with the deployments that name each."""
        deployments = await self.store.all()
        rows = []
        for name in sorted(self.scheduler.observer.hosts):
            if host is not None and name != host:
                continue
            found = await self.state.host_models.get(name)
            if found is not None:
                rows += _model_rows(name, found, deployments.values())
        if host is not None and not rows and host not in self.scheduler.observer.hosts:
            raise _no_host(host)
        return rows

    async def pull(self, request: PullRequest) -> StoreOperationAnswer:
        """Send a host the download of a pinned Hub source into its store."""
        host = self._store_host(request.host)
        try:
            source = HubSource(request.repo, request.revision, tuple(request.files))
            name = f"{HUB_STORE}/{source.store_name(request.revision)}"
        except InvalidConfig as exc:
            raise InvalidRequest(exc.message) from None
        wanted = HubPull(repo=source.repo, commit=source.revision, files=source.files)
        op = operation_id()
        await self.state.commands.send(host, Pull(operation=op, source=wanted))
        return StoreOperationAnswer(
            operation_id=op, host=host, kind="pull", state="sent", name=name
        )

    async def remove(self, request: RemoveRequest) -> StoreOperationAnswer:
        """Send a host the removal of a download from its store, unless a deployment names
        it (hostd refuses too while an engine runs from it)."""
        host = self._store_host(request.host)
        users = sorted(
            record.name
            for record in (await self.store.all()).values()
            if named_path(record.document.model) == request.name
        )
        if users:
            raise ModelInUse(
                f"{request.name} is the model of {', '.join(users)}; delete "
                f"{'that deployment' if len(users) == 1 else 'those deployments'} first "
                f"(capyctl delete deployment {users[0]})"
            )
        op = operation_id()
        await self.state.commands.send(host, Remove(operation=op, name=request.name))
        return StoreOperationAnswer(
            operation_id=op, host=host, kind="remove", state="sent", name=request.name
        )

    async def engine_log(self, name: str, lines: int) -> EngineLog:
        """The last lines of the deployment's engine log, asked of the host that runs (or ran)
        its instance."""
        await self._get(name)
        snap = await self.snapshot()
        instance = snap.instances.get(name)
        if instance is None:
            return EngineLog(
                deployment=name, host="", kept="none", lines=[], note="it has never run"
            )
        view = snap.hosts.get(instance.host)
        if view is not None and not view.reachable:
            raise HostUnreachable(
                f"host {instance.host}, where {name!r} runs, cannot be reached; ask again once "
                "it is back"
            )
        tail = await self.state.engine_logs.request(instance.host, name, lines, ENGINE_LOG_WAIT_S)
        if tail is None:
            raise AgentUnreachable(
                f"hostd on host {instance.host} did not answer within {ENGINE_LOG_WAIT_S:g} s; "
                "is it running? (capyctl status)"
            )
        return EngineLog(deployment=name, host=instance.host, **tail.model_dump())

    async def store_operation(self, host: str, op: str) -> StoreOperationAnswer:
        """How a pull or removal goes; `sent` until hostd begins it."""
        if host not in self.scheduler.observer.hosts:
            raise _no_host(host)
        found = await self.state.downloads.operation(host, op)
        if found is None:
            return StoreOperationAnswer(operation_id=op, host=host, kind="", state="sent", name="")
        download = None if found.download is None else _download(host, found.download)
        return StoreOperationAnswer(
            operation_id=op,
            host=host,
            kind=found.kind,
            state=found.state,
            name=found.name,
            download=download,
            code=found.code,
            message=found.message,
        )

    def _store_host(self, host: str | None) -> str:
        """The host a store operation is for: the one named, or the role's only host."""
        hosts = sorted(self.scheduler.observer.hosts)
        if host is None:
            if len(hosts) == 1:
                return hosts[0]
            raise InvalidRequest(
                f"this role has {len(hosts)} hosts ({', '.join(hosts) or 'none yet'}); name "
                "one with --host"
            )
        if host not in hosts:
            raise _no_host(host)
        return host

    async def _get(self, name: str) -> DeploymentRecord:
        record = await self.store.get(name)
        if record is None:
            raise NotFound(f"no deployment named {name!r}; list them with capyctl list deployments")
        return record


def _check_declarable(
    name: str, current: DeploymentRecord | None, expected_revision: int | None
) -> None:
    """Refuse a declaration while the deployment is being deleted, or when the caller expected
    another revision than the one it is at."""
    if current is not None and current.deleting:
        raise LifecycleConflict(
            f"deployment {name!r} is being deleted; wait until it is gone, then deploy it again"
        )
    revision = current.revision if current else 0
    if expected_revision is not None and revision != expected_revision:
        raise RevisionConflict(
            f"deployment {name!r} is at revision {revision}, not {expected_revision}; read it again"
        )


def _revised(
    current: DeploymentRecord | None, deployment: Deployment, digest: str, change: Change, op: str
) -> DeploymentRecord:
    """The record of the deployment's next revision (its first for a new one), with its
    attempts counted afresh."""
    now = time.time()
    revision = 1 if current is None else current.revision + 1
    base = current or DeploymentRecord(
        name=deployment.name,
        revision=0,
        digest=digest,
        document=deployment,
        created_at=now,
        updated_at=now,
    )
    operation = Operation(
        kind="deploy", reason=f"revision {revision} {change}", at=now, operation_id=op
    )
    return base.model_copy(
        update={
            "revision": revision,
            "digest": digest,
            "document": deployment,
            "updated_at": now,
            "attempts": Attempts(),
            "last_operation": operation,
        }
    )


def _no_host(host: str) -> NotFound:
    return NotFound(f"no host named {host!r}; list them with capyctl list hosts")


def _download(host: str, found: host_records.Download) -> Download:
    """A download's figures as the management API shows them."""
    return Download(host=host, **found.model_dump(include=_DOWNLOAD_FIELDS))


def _model_rows(
    host: str, models: HostModels, deployments: Iterable[DeploymentRecord]
) -> list[ModelRow]:
    named: dict[str, list[str]] = {}
    for record in deployments:
        written = named_path(record.document.model)
        if written is not None:
            named.setdefault(written, []).append(record.name)
    listed = {**models.models, **models.described}
    rows = []
    for name, facts in sorted(listed.items()):
        if facts.kind not in ("folder", "file"):
            continue
        repo, commit = hub_origin(name)
        rows.append(
            ModelRow(
                host=host,
                name=name,
                path=facts.path,
                kind=facts.kind,
                weights_bytes=facts.weights_bytes,
                repo=repo,
                commit=commit,
                used_by=sorted(named.get(name, [])),
            )
        )
    return rows
