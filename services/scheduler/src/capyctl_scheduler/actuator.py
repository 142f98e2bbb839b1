"""Applying the plan: each action becomes a deployment-record write, an instance transition
the scheduler owns (draining), and a command on the host's stream.

The record (with the effect in flight) and the command are written in one Redis transaction,
so a scheduler killed in between leaves either both or neither.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from capycommon.domain import commands as hc
from capycommon.domain.desired import (
    Attempts,
    Choice,
    DeploymentRecord,
    Inflight,
    Operation,
    Refusal,
    Switch,
)
from capycommon.domain.instances import Event, InstanceState
from capycommon.errors import ActivationFailed
from capycommon.state.desired import RETRY_COOLDOWNS_S
from capycommon.state.store import Conflict
from capycommon.state.stores import State
from capyctl_scheduler.actions import Action, Kind
from capyctl_scheduler.launchcommand import launch_command
from capyctl_scheduler.snapshot import Snapshot

log = logging.getLogger(__name__)
S = InstanceState
GiB = 1 << 30
# The transitions that end a start or a wake.
READIED = (("starting", "ready"), ("waking", "ready"))
_DOWNLOAD_FAILED = re.compile(r"download failed \[([a-z_]+)\]")

AckDemands = Callable[[str], Coroutine[Any, Any, None]]


@dataclass
class Actuator:
    state: State
    ack_demands: AckDemands
    # The fencing epoch of the lease this scheduler holds, sent with each instance command
    # (None: no lease, as in the tests that plan without one).
    epoch: int | None = None
    # Orphan stops already sent: member@host -> when (a stop is not repeated every tick).
    _orphan_stops: dict[str, float] = field(default_factory=dict)

    async def apply(self, snapshot: Snapshot, actions: list[Action]) -> None:
        for action in sorted(actions, key=lambda action: _order(snapshot, action)):
            try:
                await self._apply(snapshot, action)
            except Conflict as exc:
                now = exc.current.state if exc.current else "absent"
                log.info("%s of %s lost a race (now %s)", action.kind, action.deployment, now)

    async def _apply(self, snapshot: Snapshot, action: Action) -> None:
        if action.kind == "mark_unreachable":
            await self.state.host_marks.mark_unreachable(action.host, snapshot.now)
            await self._event(action)
            return
        if action.kind == "mark_reachable":
            await self.state.host_marks.mark_reachable(action.host)
            await self._event(action)
            return
        record = await self.state.deployments.get(action.deployment)
        if action.kind == "stop" and (record is None or record.generation != action.generation):
            await self._stop_orphan(snapshot, action)
            return
        if record is None:
            return
        await HANDLERS[action.kind](self, snapshot, record, action)

    # Effects on the engines -------------------------------------------------------------

    async def _start(self, snapshot: Snapshot, record: DeploymentRecord, action: Action) -> None:
        command = launch_command(snapshot, record, action)
        instance = snapshot.instances.get(record.name)
        await self._send(
            record.model_copy(
                update={
                    "generation": action.generation,
                    "host": action.host,
                    "park_requested": None,
                    "refusal": None,
                    "placed": action.placed or None,
                }
            ),
            action,
            command,
            Inflight(
                kind="launch",
                host=action.host,
                gpu=action.gpu,
                generation=action.generation,
                sent_at=time.time(),
                from_state=instance.state if instance else None,
                from_generation=instance.generation if instance else None,
                reason=action.reason,
            ),
        )

    async def _wake(self, snapshot: Snapshot, record: DeploymentRecord, action: Action) -> None:
        command = hc.Wake(
            **_addressed(record, action), wake_deadline_s=snapshot.tunables.wake_deadline_s
        )
        # A wake ends an operator's park: that park was done (the model parked), and the
        # demand that wakes it overrides it, so the model stays ready like any demanded one.
        woken = record.model_copy(update={"park_requested": None})
        await self._send(woken, action, command, self._effect("wake", action, S.PARKED))

    async def _park(self, snapshot: Snapshot, record: DeploymentRecord, action: Action) -> None:
        command = hc.Park(
            **_addressed(record, action),
            release_bound_bytes=action.release_bound,
            verify_s=snapshot.tunables.park_verify_s,
        )
        await self._send_from_instance(snapshot, record, action, command)

    async def _stop(self, snapshot: Snapshot, record: DeploymentRecord, action: Action) -> None:
        command = hc.Stop(**_addressed(record, action), keep_cache=action.keep_cache)
        await self._send_from_instance(snapshot, record, action, command)

    async def _release(self, snapshot: Snapshot, record: DeploymentRecord, action: Action) -> None:
        """Stop the LMCache server a restart_only park kept: no effect to follow (the
        instance stays stopped); the plan asks again until its record names no server."""
        await self._stop_orphan(snapshot, action)

    async def _stop_orphan(self, snapshot: Snapshot, action: Action) -> None:
        member = f"{action.deployment}:0:{action.generation}@{action.host}"
        sent = self._orphan_stops.get(member)
        if sent is not None and time.time() - sent < snapshot.tunables.command_timeout_s:
            return
        self._orphan_stops[member] = time.time()
        command = hc.Stop(
            deployment=action.deployment, generation=action.generation, reason=action.reason
        )
        await self.state.commands.send(action.host, command, self.epoch)
        await self._event(action)

    async def _drain(self, snapshot: Snapshot, record: DeploymentRecord, action: Action) -> None:
        instance = snapshot.instances[record.name]
        effect = self._effect("drain", action, instance.state).model_copy(
            update={"then": action.then}
        )
        await self._write(record, action, inflight=effect)
        try:
            await self.state.instances(action.host).transition(
                instance.model_copy(update={"state": S.DRAINING, "since": time.time()}),
                allowed=[S.READY],
                generation=instance.generation,
                reason=f"drain: {action.reason}",
                previous=instance,
            )
        except Conflict:
            await self._write(record, action, inflight=None)
            raise

    async def _undrain(self, snapshot: Snapshot, record: DeploymentRecord, action: Action) -> None:
        instance = snapshot.instances[record.name]
        await self.state.instances(action.host).transition(
            instance.model_copy(update={"state": S.READY, "since": time.time()}),
            allowed=[S.DRAINING],
            generation=instance.generation,
            reason=action.reason,
            previous=instance,
        )
        await self._write(record, action, inflight=None)

    # Bookkeeping ----------------------------------------------------------------------------

    async def _count_failure(
        self, snapshot: Snapshot, record: DeploymentRecord, action: Action
    ) -> None:
        count = record.attempts.count + 1
        code = _download_code(action.error)
        if code is not None and count == 1:
            count = 2  # a download refused for a reason a retry does not change: no retry now
        failed = count > len(RETRY_COOLDOWNS_S)
        next_at = None if failed else snapshot.now + RETRY_COOLDOWNS_S[count - 1]
        attempts = Attempts(
            count=count,
            next_at=next_at,
            last_error=action.error,
            failed=failed,
            counted_generation=action.generation,
        )
        cooldown = 0.0 if failed else RETRY_COOLDOWNS_S[count - 1]
        if failed:
            reason = f"failed after {count} starts: {action.error}"
            then = f"an operator start tries again (capyctl start deployment {record.name})"
        elif cooldown:
            reason = f"start {count} failed, retry in {cooldown:.0f}s: {action.error}"
            then = f"a request starts it again in {cooldown:.0f} s"
        else:
            reason = f"start {count} failed, retrying now: {action.error}"
        changes: dict[str, object] = {}
        if failed or cooldown:
            # The requests waiting now would wait out the cooldown: they are answered with
            # the failure at once, and a later request asks anew (a start retried at once,
            # after a first failure, keeps them waiting).
            await self.ack_demands(record.name)
            message = f"deployment {record.name!r} could not start: {action.error}; {then}"
            refusal = Refusal(code=code or ActivationFailed.code, message=message, at=time.time())
            changes["refusal"] = refusal
        await self._write(
            record.model_copy(update={"attempts": attempts}),
            Action("count_failure", record.name, reason, generation=action.generation),
            **changes,
        )

    async def _satisfied(
        self, snapshot: Snapshot, record: DeploymentRecord, action: Action
    ) -> None:
        await self.ack_demands(record.name)
        if record.attempts.count:
            await self._write(record.model_copy(update={"attempts": Attempts()}), action)

    async def _drop_demand(
        self, snapshot: Snapshot, record: DeploymentRecord, action: Action
    ) -> None:
        await self.ack_demands(record.name)
        await self._event(action)

    async def _refuse(self, snapshot: Snapshot, record: DeploymentRecord, action: Action) -> None:
        """Answer the demands with the refusal: the routers fail the requests it covers. An
        operator's start of an explicit deployment is refused the same way."""
        await self.ack_demands(record.name)
        message = action.reason.removeprefix(f"{action.error}: ")
        refusal = Refusal(code=action.error, message=message, at=time.time())
        changes: dict[str, object] = {"refusal": refusal}
        if record.activation == "explicit" and record.wanted == "ready":
            changes["wanted"] = None
        await self._write(record, action, **changes)

    async def _wait(self, snapshot: Snapshot, record: DeploymentRecord, action: Action) -> None:
        """Note the wait (once per reason); a switch's wait records the switch on the record
        first: when it began, kept from its first victim on, and every victim since."""
        changes: dict[str, object] = {}
        if action.victims:
            switch = _switch(record, action)
            if switch != record.switch:
                changes["switch"] = switch
        last = record.last_operation
        if changes or last is None or (last.kind, last.reason) != ("wait", action.reason):
            await self._write(record, action, **changes)

    async def _settle(self, snapshot: Snapshot, record: DeploymentRecord, action: Action) -> None:
        """Clear a finished effect; a park or stop that took an engine out is counted, once,
        as an eviction with its cause (in the same write)."""
        if record.inflight is None:
            return
        settled = record.model_copy(update={"inflight": None})
        if action.cause is None:
            await self.state.deployments.put(settled)
            return
        effect = record.inflight
        evicted = Choice(
            kind="evicted",
            deployment=record.name,
            reason=f"{effect.kind}: {effect.reason}",
            host=effect.host,
            generation=effect.generation,
            at=time.time(),
            cause=action.cause,
        )
        await self.state.deployments.put(settled, evicted.model_dump_json(exclude_none=True))

    async def _switched(self, snapshot: Snapshot, record: DeploymentRecord, action: Action) -> None:
        """A switch ended with its deployment ready: its duration, from the choice to
        release its first victim to the ready transition, and the engines' part of it, as a
        choice; the record's switch is cleared in the same write, so it counts once."""
        switch, instance = record.switch, snapshot.instances.get(record.name)
        if switch is None or instance is None:
            return
        took = max(0.0, instance.since - switch.started_at)
        hosts = {switch.host, instance.host}
        events = [e for host in sorted(hosts) for e in await self._events(host, switch.started_at)]
        engine = min(took, switch_engine_s(switch, instance.generation, record.name, events))
        ended = Choice(
            kind="switched",
            deployment=record.name,
            reason=action.reason,
            host=instance.host,
            generation=instance.generation,
            at=time.time(),
            duration_s=round(took, 3),
            engine_s=round(engine, 3),
        )
        cleared = record.model_copy(update={"switch": None})
        await self.state.deployments.put(cleared, ended.model_dump_json(exclude_none=True))

    async def _drop_switch(
        self, snapshot: Snapshot, record: DeploymentRecord, action: Action
    ) -> None:
        if record.switch is not None:
            await self._write(record.model_copy(update={"switch": None}), action)

    async def _events(self, host: str, since: float) -> list[Event]:
        """A host's events from `since` (Unix seconds) on."""
        cursor, found = f"{int(since * 1000)}-0", []
        while True:
            read = await self.state.events.after({host: cursor}, count=1000)
            found += [event for _, _, event in read if event is not None]
            if len(read) < 1000:
                return found
            cursor = read[-1][1]

    async def _forget(self, snapshot: Snapshot, record: DeploymentRecord, action: Action) -> None:
        await self._event(action)
        await self.state.deployments.forget(record.name)
        for host in snapshot.hosts:
            await self.state.instances(host).forget(record.name, 0)
        await self.ack_demands(record.name)

    # Writing --------------------------------------------------------------------------------

    def _effect(self, kind: str, action: Action, from_state: str) -> Inflight:
        return Inflight.model_validate(
            {
                "kind": kind,
                "host": action.host,
                "gpu": action.gpu,
                "generation": action.generation,
                "sent_at": time.time(),
                "from_state": from_state,
                "from_generation": action.generation,
                "reason": action.reason,
                "cause": action.cause,
            }
        )

    async def _send(
        self,
        record: DeploymentRecord,
        action: Action,
        command: hc.Launch | hc.Park | hc.Wake | hc.Stop,
        inflight: Inflight,
    ) -> None:
        """The record with its effect in flight and the command, in one transaction."""
        sending = _with_operation(record, action).model_copy(update={"inflight": inflight})
        await self.state.deployments.send(
            sending, _choice_json(action), action.host, command, self.epoch
        )
        log.info("%s %s on %s: %s", action.kind, record.name, action.host, action.reason)

    async def _send_from_instance(
        self,
        snapshot: Snapshot,
        record: DeploymentRecord,
        action: Action,
        command: hc.Park | hc.Stop,
    ) -> None:
        """Send a command to the running instance, with its effect in flight from the state
        the instance is in now."""
        instance = snapshot.instances[record.name]
        await self._send(record, action, command, self._effect(action.kind, action, instance.state))

    async def _write(
        self, record: DeploymentRecord, action: Action, **changes: object
    ) -> DeploymentRecord:
        changed = _with_operation(record, action).model_copy(update=changes)
        return await self.state.deployments.put(changed, _choice_json(action))

    async def _event(self, action: Action) -> None:
        await self.state.deployments.chose(_choice_json(action))


Handler = Callable[[Actuator, Snapshot, DeploymentRecord, Action], Coroutine[Any, Any, None]]

# How each kind of action is applied; a test holds every kind to a handler.
HANDLERS: Mapping[Kind, Handler] = {
    "start": Actuator._start,
    "wake": Actuator._wake,
    "drain": Actuator._drain,
    "undrain": Actuator._undrain,
    "park": Actuator._park,
    "stop": Actuator._stop,
    "release": Actuator._release,
    "count_failure": Actuator._count_failure,
    "satisfied": Actuator._satisfied,
    "drop_demand": Actuator._drop_demand,
    "wait": Actuator._wait,
    "settle": Actuator._settle,
    "forget": Actuator._forget,
    "refuse": Actuator._refuse,
    "switched": Actuator._switched,
    "drop_switch": Actuator._drop_switch,
}


def _switch(record: DeploymentRecord, action: Action) -> Switch:
    """The deployment's switch with the wait's victims: when it began, kept from its first
    victim on, and every victim since."""
    began = record.switch
    victims = (*(began.victims if began else ()), *action.victims)
    return Switch(
        host=action.host,
        gpu=action.gpu,
        started_at=began.started_at if began else time.time(),
        victims=tuple(dict.fromkeys(victims)),
    )


def _order(snapshot: Snapshot, action: Action) -> int:
    """When an action is applied in its plan: a switch is recorded on its deployment before
    any of its victims is released, so a scheduler killed in between still knows when it
    began; any other wait (bookkeeping only) after every command, which is what it waits on."""
    if action.kind != "wait":
        return 1
    record = snapshot.deployments.get(action.deployment)
    records = record is not None and action.victims and _switch(record, action) != record.switch
    return 0 if records else 2


def _download_code(error: str | None) -> str | None:
    """The code of a failed model download (hostd writes `download failed [<code>]: ...`)."""
    found = _DOWNLOAD_FAILED.search(error or "")
    return found[1] if found else None


class _Addressed(TypedDict):
    """What each command to a deployment's engine names: the deployment, the generation the
    action is for, and why."""

    deployment: str
    generation: int
    reason: str


def _addressed(record: DeploymentRecord, action: Action) -> _Addressed:
    return {"deployment": record.name, "generation": action.generation, "reason": action.reason}


def _with_operation(record: DeploymentRecord, action: Action) -> DeploymentRecord:
    operation = Operation(kind=action.kind, reason=action.reason, at=time.time())
    return record.model_copy(update={"last_operation": operation})


def _choice_json(action: Action) -> str:
    return Choice(
        kind=action.kind,
        deployment=action.deployment,
        reason=action.reason,
        host=action.host or None,
        generation=action.generation or None,
        at=time.time(),
        cause=action.cause,
    ).model_dump_json(exclude_none=True)


def switch_engine_s(switch: Switch, generation: int, name: str, events: list[Event]) -> float:
    """The engines' own part of a switch, from the hosts' events since it began: each
    victim's sleep call (its park) and its stop (from stopping to stopped: the engine's exit),
    and the deployment's load or wake calls (its transition to ready)."""
    victims = {(v.deployment, v.generation) for v in switch.victims}
    engine = target = 0.0
    for event in events:
        if event.kind != "transition" or event.at < switch.started_at:
            continue
        of = (event.deployment, event.generation)
        if of in victims and event.to_state == "parked":
            engine += event.engine_s or 0.0
        elif of in victims and (event.from_state, event.to_state) == ("stopping", "stopped"):
            engine += event.duration_s or 0.0
        elif of == (name, generation) and (event.from_state, event.to_state) in READIED:
            target = event.engine_s or 0.0
    return engine + target
