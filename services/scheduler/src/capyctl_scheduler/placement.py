"""Placement: a start goes to one GPU of a host, the one with the most headroom in the ledger,
or, for a model across several, to a set of GPUs of one host: one where it fits now, the
tightest by topology, with the most headroom; among the hosts the deployment may run on
(`best`, with the reasons `explain` gives). A pinned one goes to the GPUs it is pinned to; a
parked instance wakes where it parked. When no host may take it now,
`none_fits` says why: a refusal when only an operator (or a host coming back) changes that,
else a wait.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cache

from capycommon.domain.desired import DeploymentRecord
from capycommon.errors import HostDrained, HostUnreachable
from capycommon.units import format_duration, format_size
from capyctl_scheduler import gpusets
from capyctl_scheduler.actions import Action
from capyctl_scheduler.ledger import Ledger
from capyctl_scheduler.snapshot import Binding, HostView, Snapshot

# How many losing sets, and hosts that may not take it, `explain` names; and its most
# characters (the deployment record keeps it: `DeploymentRecord.placed`).
MAX_TOLD = 4
MAX_WHY = 1000


@dataclass(frozen=True)
class Placed:
    """Where a start goes: the host and GPU set chosen, and every set weighed (`explain`)."""

    host: str
    gpu: str
    chosen: _Choice
    choices: tuple[_Choice, ...]
    # How many more were weighed than `choices` holds.
    more: int = 0


def best(snapshot: Snapshot, record: DeploymentRecord, ledgers: dict[str, Ledger]) -> Placed | None:
    """The host and GPU set a start of `record` goes to. For a model across several GPUs, a
    set where its start fits now comes first, then the tightest set (NVLink before a PCIe
    switch, a host bridge, a NUMA node, the system: `gpusets.tightness`); then the most
    headroom (of the set's fullest GPU); on a tie the first host, then the lowest GPU
    indices. None when no host may take it now."""
    if record.document.gpu_count == 1:
        return _best_gpu(snapshot, record, ledgers)
    choices: list[_Choice] = []
    for host, binding in _allowed(snapshot, record):
        view = snapshot.hosts.get(host)
        if view is None or _unplaceable(snapshot, view, binding) is not None:
            continue
        ledger = ledgers[host]
        for place, members in _places(view, binding):
            choices.append(_choice(view, ledger, record.name, binding, place, members))
    if not choices:
        return None
    chosen = max(choices, key=lambda c: c.rank)
    return Placed(chosen.host, chosen.place, chosen, tuple(choices))


def _best_gpu(
    snapshot: Snapshot, record: DeploymentRecord, ledgers: dict[str, Ledger]
) -> Placed | None:
    """`best` for a model on one GPU: the most headroom, then the first host and the lowest
    index. The plan asks this of every demanded deployment on every GPU of every host, so it
    weighs plain tuples and keeps only the few `explain` names."""
    ranked: list[tuple[int, tuple[int, ...], int, str, str]] = []
    for host, binding in _allowed(snapshot, record):
        view = snapshot.hosts.get(host)
        if view is None or _unplaceable(snapshot, view, binding) is not None:
            continue
        ledger, host_rank = ledgers[host], _neg(host)
        for gpu, domain in _gpus(view, record):
            if domain in view.domains and gpu in binding.footprints:
                ranked.append((ledger.headroom(domain), host_rank, -gpusets.index(gpu), host, gpu))
    if not ranked:
        return None
    kept = [
        _Choice(host, gpu, None, headroom, (True, (0, 0), headroom, host_rank, (gpu_rank,)))
        for headroom, host_rank, gpu_rank, host, gpu in heapq.nlargest(MAX_TOLD + 1, ranked)
    ]
    more = len(ranked) - len(kept)
    return Placed(kept[0].host, kept[0].place, kept[0], tuple(kept), more)


def _gpus(view: HostView, record: DeploymentRecord) -> list[tuple[str, str]]:
    """The GPUs a deployment on one GPU may start on, each with its ledger domain."""
    pinned = record.document.pinned
    if view.unified:
        return view.gpu_domains[:1]
    return [(pinned[0], view.domain_of(pinned[0]))] if pinned else view.gpu_domains


Rank = tuple[bool, tuple[int, int], int, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class _Choice:
    host: str
    place: str
    # Whether its start fits now (None for one GPU, whose headroom says as much).
    fits: bool | None
    headroom: int
    # (fits, tighter, headroom, the first host, the lowest indices): the greatest wins.
    rank: Rank


def _choice(
    view: HostView,
    ledger: Ledger,
    name: str,
    binding: Binding,
    place: str,
    members: tuple[str, ...],
) -> _Choice:
    fits = ledger.fits(name, binding.footprints[place].charge("starting"))
    headroom = min(ledger.headroom(domain) for domain in view.domains_of(place))
    worst, total = gpusets.tightness(place, view.links)
    indices = tuple(-gpusets.index(gpu) for gpu in members)
    spans: Rank = (fits, (-worst, -total), headroom, _neg(view.name), indices)
    return _Choice(view.name, place, fits, headroom, spans)


def explain(snapshot: Snapshot, record: DeploymentRecord, placed: Placed) -> str:
    """What placement weighed, for status: the set chosen and each other set's or host's
    reason to lose (a few at most), within MAX_WHY characters."""

    def told(choice: _Choice) -> str:
        headroom = f"{format_size(choice.headroom)} headroom"
        if choice.fits is None:
            return headroom
        room = "its start fits now" if choice.fits else "needs a switch to fit"
        links = gpusets.describe_link(choice.place, snapshot.hosts[choice.host].links)
        return f"{room}, {links}, {headroom}"

    chosen = placed.chosen
    lines = [f"{chosen.host} {chosen.place}: {told(chosen)}"]
    others = sorted(
        (c for c in placed.choices if c is not chosen), key=lambda c: c.rank, reverse=True
    )
    lines += [f"not {c.host} {c.place}: {told(c)}" for c in others[:MAX_TOLD]]
    if len(others) + placed.more > MAX_TOLD:
        lines.append(f"and {len(others) + placed.more - MAX_TOLD} other sets")
    hosts = [
        f"not host {host}: {reason}"
        for host, binding in _allowed(snapshot, record)
        if (reason := _unplaceable(snapshot, snapshot.hosts.get(host), binding)) is not None
    ]
    lines += hosts[:MAX_TOLD]
    if len(hosts) > MAX_TOLD:
        lines.append(f"and {len(hosts) - MAX_TOLD} other hosts")
    why = "; ".join(lines)
    return why if len(why) <= MAX_WHY else why[: MAX_WHY - 3] + "..."


def _places(view: HostView, binding: Binding) -> list[tuple[str, tuple[str, ...]]]:
    """The GPU sets of `view` a model across several GPUs may take, each with its GPUs: those
    its binding has footprints for (only the pinned set, where it names its devices) whose
    GPUs the host's reading observes."""
    found = []
    for place in binding.footprints:
        members = gpusets.members(place)
        if all(view.domain_of(gpu) in view.domains for gpu in members):
            found.append((place, members))
    return found


def none_fits(snapshot: Snapshot, record: DeploymentRecord) -> Action:
    """Why no host may start it now: a refusal when waiting changes nothing until an operator
    acts (or a host comes back), else a wait naming each host's reason."""
    refusal = _blocked(snapshot, record)
    if refusal is not None:
        return refusal
    allowed = _allowed(snapshot, record)
    bindings = [binding for _, binding in allowed]
    errors = [binding.error for binding in bindings if binding.error is not None]
    if errors and len(errors) == len(bindings):
        # The document cannot run on any host (its engine, its model, its park tier):
        # waiting changes nothing until an operator does.
        first = errors[0]
        return Action("refuse", record.name, f"{first.code}: {first.message}", error=first.code)
    why_not = [
        f"{host}: no such host has joined"
        for host in record.document.placement.hosts
        if host not in snapshot.hosts
    ]
    for host, binding in allowed:
        reason = _unplaceable(snapshot, snapshot.hosts.get(host), binding)
        if reason is not None:
            why_not.append(f"{host}: {reason}")
    reasons = "; ".join(why_not) or "no hosts"
    return Action("wait", record.name, "no host can run it: " + reasons)


def unreachable(snapshot: Snapshot, record: DeploymentRecord, view: HostView) -> list[Action]:
    """A demand for a deployment whose instance is on a host that cannot be reached now: it
    waits for the host's grace to pass when another host may take it (its instance then counts
    as gone, and it starts there), and is refused at once when none may."""
    why = view.why_not_reachable(snapshot.now)
    if any(
        other.name != view.name and other.reachable and not other.drained
        for other in _could_run(snapshot, record)
    ):
        grace = snapshot.tunables.host_lost_after_s
        return [
            Action(
                "wait",
                record.name,
                f"{why}; it starts on another host once the host is gone for "
                f"{format_duration(grace)}, unless it comes back",
            )
        ]
    message = (
        f"{why}; {record.name!r} may run nowhere else, so it serves again once the host is back"
    )
    return [Action("refuse", record.name, message, error=HostUnreachable.code)]


def _allowed(snapshot: Snapshot, record: DeploymentRecord) -> list[tuple[str, Binding]]:
    """The hosts the deployment may run on (placement.hosts), each with its binding there."""
    return [
        (host, binding)
        for host, binding in sorted(snapshot.bindings.get(record.name, {}).items())
        if record.document.allows(host)
    ]


def _could_run(snapshot: Snapshot, record: DeploymentRecord) -> list[HostView]:
    """The hosts the deployment may run on (placement.hosts) and could: each has its model
    and an engine of its family (its binding is no error)."""
    bindings = snapshot.bindings.get(record.name, {})
    return [
        view
        for name, view in snapshot.hosts.items()
        if record.document.allows(name)
        and (binding := bindings.get(name)) is not None
        and binding.error is None
    ]


@cache
def _neg(host: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in host)


def _blocked(snapshot: Snapshot, record: DeploymentRecord) -> Action | None:
    """A refusal when every host that could run the deployment (it may, and has its model and
    engine) is unreachable or drained: it cannot start until one comes back or is undrained,
    so its requests fail at once."""
    named = record.document.placement.hosts
    if any(host not in snapshot.hosts for host in named):
        return None  # a host it names has yet to join: it may
    views = _could_run(snapshot, record)
    if not views:
        return None  # no host has what it needs: refused (or waited for) on that
    if not all(not view.reachable or view.drained for view in views):
        return None
    unreachable = [view for view in views if not view.reachable]
    if unreachable:
        why = "; ".join(view.why_not_reachable(snapshot.now) for view in unreachable)
        message = f"{why}; {record.name!r} may run on no other host now"
        return Action("refuse", record.name, message, error=HostUnreachable.code)
    names = ", ".join(view.name for view in views)
    message = (
        f"every host {record.name!r} may run on is drained ({names}); undrain one with "
        "capyctl undrain host NAME, or widen its placement.hosts"
    )
    return Action("refuse", record.name, message, error=HostDrained.code)


def _unplaceable(snapshot: Snapshot, view: HostView | None, binding: Binding) -> str | None:
    """Why a host may not take a start now; None when it may."""
    if view is None or not view.reachable or view.drained or not view.alive:
        return _host_unusable(snapshot, view)
    if binding.error is not None:
        return f"{binding.error.code}: {binding.error.message}"
    if binding.waiting is not None:
        return binding.waiting
    if not view.domains:
        return "device_unobserved: no fresh memory reading"
    return None


def _host_unusable(snapshot: Snapshot, view: HostView | None) -> str:
    if view is not None and not view.reachable:
        return view.why_not_reachable(snapshot.now)
    if view is not None and view.drained:
        return f"host {view.name} is drained"
    return "its hostd is not running"
