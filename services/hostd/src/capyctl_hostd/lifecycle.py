"""Park, wake, stop and abort: what the scheduler asks of an instance once it runs.

A park is the engine's park call, then, when the scheduler sent a parked charge, memwatch's
word that the memory is released (`release`); else the engine is stopped, so the parked charge
never stands for memory it still holds. A wake costs what the engine's own calls cost: its
wake calls, then the canary as soon as they return. hostd's log line for each (`parked`,
`woke`) gives the moment each step ended (`steps`). A stop tears the instance down (its
LMCache server too, unless a restart_only park keeps it); an abort is the engine's own, or
followed to its end (`settle`) where the engine reports it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from capycommon.domain import commands as hc
from capycommon.domain.engines import Residency
from capycommon.domain.instances import LIVE_STATES, InstanceRecord, InstanceState
from capycommon.engines.adapters import adapter_for
from capycommon.engines.control import EngineControl
from capycommon.errors import CapyError
from capycommon.state.stores import State
from capyctl_hostd import engines, release
from capyctl_hostd.holdings import Holdings
from capyctl_hostd.settle import Settler
from capyctl_hostd.steps import Steps

log = logging.getLogger(__name__)
S = InstanceState


@dataclass
class Lifecycle:
    holdings: Holdings
    state: State  # for memwatch's readings while a park settles
    settler: Settler

    async def park(self, record: InstanceRecord, command: hc.Park) -> None:
        """The engine's park call, then, when the scheduler sent a parked charge, memwatch's
        word that the memory is released; hostd logs when each step ended (`steps`)."""
        steps = Steps()
        if record.state not in (S.READY, S.DRAINING):
            await self.holdings.refuse_record(record, "park", f"the instance is {record.state}")
            return
        engine = self.holdings.engines.get(record.member)
        if engine is None:
            await self.holdings.refuse_record(record, "park", "hostd does not hold this engine")
            return
        record, residency, control = await self._begin(
            record, engine, S.PARKING, "park", command.reason, steps
        )
        try:
            await control.park(residency)
        except CapyError as exc:
            await self.holdings.fail(record, f"park failed: {exc.message}")
            return
        steps.mark("slept")
        if command.release_bound_bytes is None:
            engine_s = steps.between("park call", "slept")
            await self.holdings.move(record, S.PARKED, f"parked ({residency})", engine_s=engine_s)
        elif not await self._settle_park(
            record, engine.pgid, residency, command.release_bound_bytes, command.verify_s, steps
        ):
            return
        log.info("parked", extra={"member": record.member, "steps": steps.marks})

    async def _settle_park(
        self,
        record: InstanceRecord,
        pgid: int,
        residency: Residency,
        bound: int,
        verify_s: float,
        steps: Steps,
    ) -> bool:
        """Parked once memwatch shows the memory released (True); else stopped, so the
        scheduler's parked charge never stands for memory the engine still holds."""
        seen = await release.watch(self.state, record, pgid, bound, verify_s, since=time.time())
        released, reason = release.judge(seen, bound, verify_s, residency)
        if released:
            steps.mark("released")
            engine_s = steps.between("park call", "slept")
            await self.holdings.move(record, S.PARKED, reason, engine_s=engine_s)
            return True
        log.error("%s: %s", record.member, reason)
        record = await self.holdings.move(record, S.STOPPING, reason)
        await self.holdings.stop_finish(record, reason)
        return False

    async def wake(self, record: InstanceRecord, command: hc.Wake) -> None:
        """The engine's wake calls, then the canary the moment they return: its answer, the
        same as at launch, is what lets requests through again."""
        steps = Steps()
        engine = self.holdings.engines.get(record.member)
        if record.state != S.PARKED or engine is None:
            await self.holdings.refuse_record(record, "wake", f"the instance is {record.state}")
            return
        record, residency, control = await self._begin(
            record, engine, S.WAKING, "wake", command.reason, steps
        )
        try:
            async with asyncio.timeout(command.wake_deadline_s):
                await control.wake(residency)
                steps.mark("woke")
                engines.check_running(engine, "while waking")
                answer = await control.canary()
                steps.mark("canary")
        except TimeoutError:
            await self.holdings.fail(
                record, f"wake failed: not awake within {command.wake_deadline_s:g} s"
            )
            return
        except CapyError as exc:
            await self.holdings.fail(record, f"wake failed: {exc.message}")
            return
        if record.canary is not None and answer != record.canary:
            await self.holdings.fail(
                record, f"wake_mismatch: the canary answered {answer!r}, not {record.canary!r}"
            )
            return
        await self.holdings.move(
            record,
            S.READY,
            "ready after wake: wake calls and canary passed",
            engine_s=steps.between("wake call", "woke"),
        )
        log.info("woke", extra={"member": record.member, "steps": steps.marks})

    async def _begin(
        self,
        record: InstanceRecord,
        engine: engines.Engine,
        state: InstanceState,
        verb: str,
        reason: str,
        steps: Steps,
    ) -> tuple[InstanceRecord, Residency, EngineControl]:
        """A park or wake begun (`verb`): the record moved to `state`, its residency and the
        engine's control client, with the step's first mark ("park call", "wake call")."""
        record = await self.holdings.move(record, state, f"{verb}: {reason}", keep_log=False)
        residency = Residency(record.residency or Residency.RESTART_ONLY)
        control = engine.control()
        steps.mark(f"{verb} call")
        return record, residency, control

    async def stop(self, record: InstanceRecord, reason: str, keep_cache: bool = False) -> None:
        if record.state not in LIVE_STATES and record.cache is not None and not keep_cache:
            await self.holdings.forget_cache(record, reason)
            return
        if record.state not in LIVE_STATES:
            await self.holdings.refuse_record(
                record, "stop", f"the instance is already {record.state}"
            )
            return
        record = await self.holdings.move(record, S.STOPPING, f"stop: {reason}")
        await self.holdings.stop_finish(record, reason, keep_cache)

    async def abort(self, record: InstanceRecord, request_id: str) -> None:
        engine = self.holdings.engines.get(record.member)
        if engine is None:
            await self.holdings.refuse_record(record, "abort", "hostd does not hold this engine")
            return
        profile = engine.spec.profile
        if adapter_for(profile.family).capabilities(profile.version).abort_reports_end:
            self.settler.follow(engine, record, request_id)
            return
        try:
            await engine.control().abort(request_id)
        except CapyError as exc:
            await self.holdings.refuse_record(record, "abort", exc.message)
