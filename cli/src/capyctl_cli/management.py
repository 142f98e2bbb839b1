"""Talking to a running role's management API: the address from its role record, the admin
token from its credentials, an Idempotency-Key per command (a retry reuses it)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from capycommon import credentials
from capycommon import management as wire
from capycommon.errors import (
    ActivationTimeout,
    AgentUnreachable,
    CapyError,
    DeviceUnobserved,
    InsufficientResources,
    Internal,
    LaunchFailed,
    RoleNotRunning,
)
from capycommon.paths import StatePaths
from capycommon.settingvalues import split_address
from capycommon.version import __version__
from capyctl_cli import record
from capyctl_cli.rolelock import lock_is_held

RETRIES = 3
Answer = TypeVar("Answer", bound=wire.Versioned)


class Management:
    """A client of the management API of the role on a state dir."""

    def __init__(self, paths: StatePaths, timeout: float = 30.0) -> None:
        found = record.read(paths) if lock_is_held(paths) else None
        address = found.listeners.get("management") if found else None
        if found is None or address is None:
            raise RoleNotRunning(
                f"no standalone or server role is running on the state dir {paths.root}; "
                "start one with `capyctl start standalone`"
            )
        host, port = split_address(address)
        host = "127.0.0.1" if host in ("0.0.0.0", "localhost") else host
        if ":" in host:
            host = f"[{host}]"
        token = credentials.load(paths.credentials).admin_token
        self.http = httpx.Client(
            base_url=f"http://{host}:{port}{wire.PREFIX}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
        )

    def __enter__(self) -> Management:
        return self

    def __exit__(self, *_: object) -> None:
        self.http.close()

    def health(self) -> wire.Health:
        return self._get("/health", wire.Health)

    def deploy(self, document: wire.JsonObject) -> wire.DeployAnswer:
        body = wire.DeployRequest(document=document)
        return self._post("/deployments", body, wire.DeployAnswer)

    def act(self, name: str, action: wire.Action) -> wire.ActionAnswer:
        body = wire.ActionRequest(action=action)
        return self._post(f"/deployments/{name}/actions", body, wire.ActionAnswer)

    def drain(self, host: str) -> wire.DrainAnswer:
        return self._post(f"/hosts/{host}/drain", wire.DrainRequest(), wire.DrainAnswer)

    def undrain(self, host: str) -> wire.UndrainAnswer:
        return self._post(f"/hosts/{host}/undrain", wire.DrainRequest(), wire.UndrainAnswer)

    def invite(self, request: wire.InvitationRequest) -> wire.InvitationAnswer:
        return self._post("/host-invitations", request, wire.InvitationAnswer)

    def revoke(self, host: str) -> wire.RevokeAnswer:
        return self._post(f"/hosts/{host}/revoke", wire.RevokeRequest(), wire.RevokeAnswer)

    def status(self, name: str) -> wire.DeploymentStatus:
        return self._get(f"/deployments/{name}", wire.DeploymentStatus)

    def deployments(self) -> list[wire.DeploymentSummary]:
        return self._get("/deployments", wire.DeploymentList).deployments

    def hosts(self) -> list[wire.HostRow]:
        return self._get("/hosts", wire.HostList).hosts

    def models(self, host: str | None = None) -> list[wire.ModelRow]:
        path = "/models" if host is None else f"/models?host={quote(host)}"
        return self._get(path, wire.ModelList).models

    def pull(self, request: wire.PullRequest) -> wire.StoreOperationAnswer:
        return self._post("/models/pull", request, wire.StoreOperationAnswer)

    def remove(self, request: wire.RemoveRequest) -> wire.StoreOperationAnswer:
        return self._post("/models/remove", request, wire.StoreOperationAnswer)

    def engine_log(self, name: str, lines: int) -> wire.EngineLog:
        path = f"/deployments/{quote(name)}/engine-log?lines={lines}"
        return self._get(path, wire.EngineLog)

    def store_operation(self, host: str, operation: str) -> wire.StoreOperationAnswer:
        path = f"/hosts/{quote(host)}/store-operations/{quote(operation)}"
        return self._get(path, wire.StoreOperationAnswer)

    def engines(self) -> list[wire.EngineRow]:
        return self._get("/engines", wire.EngineList).engines

    def _get(self, path: str, answer: type[Answer]) -> Answer:
        return self._call(self.http.build_request("GET", path), answer)

    def _post(self, path: str, body: wire.Request, answer: type[Answer]) -> Answer:
        """A mutation: the same Idempotency-Key on every retry, so it acts once."""
        headers = {"Content-Type": "application/json", "Idempotency-Key": str(uuid.uuid4())}
        content = body.model_dump_json().encode()
        return self._call(
            self.http.build_request("POST", path, content=content, headers=headers), answer
        )

    def _call(self, request: httpx.Request, answer: type[Answer]) -> Answer:
        """Send (again, with the same Idempotency-Key, when the request never reached the
        API or the API met a moment's outage of Redis: 503 `redis_unreachable`), then read
        the answer as `answer`, or its error body as the CapyError it names."""
        for attempt in range(RETRIES):
            last = attempt == RETRIES - 1
            try:
                response = self.http.send(request)
            except httpx.TransportError as exc:
                if last:
                    raise AgentUnreachable(
                        f"the management API did not answer: {exc}; is the scheduler running? "
                        "(capyctl status)"
                    ) from None
            else:
                if last or not _outage(response):
                    break
            time.sleep(0.5 * (attempt + 1))
        if response.is_error:
            raise _refusal(response)
        try:
            return answer.model_validate_json(response.content)
        except ValidationError as exc:
            raise Internal(
                f"the management API's answer to {request.method} {request.url.path} is not one "
                f"capyctl {__version__} reads ({_first(exc)}); is the scheduler the same version?"
            ) from None


def _outage(response: httpx.Response) -> bool:
    """Whether the API answered that Redis was away (the scheduler's client is finding the
    primary again, say): sent again, the request may well pass."""
    return response.status_code == 503 and b'"redis_unreachable"' in response.content


def _refusal(response: httpx.Response) -> CapyError:
    """The error body's code and message; an answer without one keeps its status and text."""
    try:
        error = wire.ErrorBody.model_validate_json(response.content).error
    except ValidationError:
        return CapyError(
            f"the management API answered {response.status_code}: {response.text[:200]}"
        )
    return CapyError(error.message, code=error.code)


def _first(exc: ValidationError) -> str:
    """The first problem of an answer: where and what."""
    problem = exc.errors()[0]
    where = ".".join(str(part) for part in problem["loc"]) or "the body"
    more = f", and {exc.error_count() - 1} more" if exc.error_count() > 1 else ""
    return f"{where}: {problem['msg']}{more}"


def wait_for(
    api: Management,
    name: str,
    done: Callable[[wire.DeploymentStatus], bool],
    timeout: float,
    what: str,
    since: float | None = None,
    seen: Callable[[wire.DeploymentStatus], None] | None = None,
) -> wire.DeploymentStatus:
    """Poll the deployment's status until `done`, a failed start (13), a placement no host
    can make, a refusal written since `since` (e.g. 4: it can never fit), or the timeout (4
    when memory was what it waited for, else 10); `seen` is shown each status read."""
    since = time.time() if since is None else since
    deadline = time.monotonic() + timeout
    status = api.status(name)
    failures = status.attempts.count
    while True:
        if seen is not None:
            seen(status)
        if done(status):
            return status
        refusal = status.refusal
        if refusal is not None and refusal.at >= since:
            raise CapyError(refusal.message, code=refusal.code)
        attempts = status.attempts
        if attempts.failed or attempts.count > failures:
            raise LaunchFailed(f"deployment {name!r} failed to start: {attempts.last_error}")
        reason = status.last_operation.reason if status.last_operation else ""
        if reason.startswith("no host can run it") and status.state == "pending":
            errors = [b.error for b in status.bindings if b.error is not None]
            if errors and len(errors) == len(status.bindings):
                raise CapyError(errors[0].message, code=errors[0].code)
        if time.monotonic() > deadline:
            for memory in (InsufficientResources, DeviceUnobserved):
                if reason.startswith(memory.code):
                    raise memory(f"deployment {name!r} is not {what}: {reason}")
            raise ActivationTimeout(
                f"deployment {name!r} is {status.state}, not {what}, after "
                f"{timeout:.0f}s; last: {reason or 'nothing yet'} (capyctl status deployment "
                f"{name})"
            )
        time.sleep(0.25)
        status = api.status(name)
