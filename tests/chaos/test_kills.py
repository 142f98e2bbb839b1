"""Chaos: each process of a standalone role is killed with SIGKILL under steady load, then the
whole role is restarted under load.

The load is CLIENTS threads of the openai SDK, each sending short chat requests to the two
models in turn, one per PERIOD_S at most (about 20 requests a second in all). After each
kill of a router process, the scheduler, hostd, memwatch, Redis or an engine:

- every declared deployment is still declared (`capyctl list deployments` and Redis);
- every engine process belongs to the process group of a live instance record (so no
  deployment has two groups), and each instance's engine is alive and ready;
- once the load stops, no request place is held: Redis's places and the router's
  `capyctl_requests_running` are 0;
- the only failed requests are those the kill could reach: those in flight on the killed
  process, and, where that process serves requests and none took over, those sent before
  service was back; each failure ends (an error status, or a connection refused or cut),
  never a hang;
- both models answer a request sent after the kill, and `capyctl status` is healthy, within
  a stated bound (RECOVERY_S, ROLE_RECOVERY_S for the role's restart).

Each kill prints one line: what was killed, the requests sent, succeeded and failed (by how
they ended), and how long until service was back.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from capycommon.domain.instances import LIVE_STATES, InstanceState
from cluster import Cluster
from support import live_processes, pid_alive, poll, processes_mentioning, wait_for

pytestmark = pytest.mark.slow

CLIENTS = 4
PERIOD_S = 0.2
# A request unanswered this long hangs (the SDK gives up and the test counts it).
HANG_S = 30.0
# Load before the kill, and after service is back, so that both sides of it are measured.
BEFORE_S = 2.0
AFTER_S = 2.0
# How long the engines and the places may take to settle once the load stops (a dead
# router worker's places stop counting within places.OWNER_TTL_S at the latest).
SETTLE_S = 20.0
# Seconds from a kill until a request sent after it was answered by each model and
# `capyctl status` is healthy. supervisord restarts a process at once and the scheduler an
# engine (measured: answers within 5 s, healthy within 10 s); the bound leaves room for a
# loaded two-core machine, and a role's restart includes its start.
RECOVERY_S = 30.0
ROLE_RECOVERY_S = 60.0
HI: Any = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Outcome:
    """One request: its model, when it was sent and when it ended (monotonic), and how:
    `ok`, `<status> <code>`, `connection` (no answer: refused or cut) or `hang`."""

    model: str
    sent: float
    ended: float
    result: str
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.result == "ok"


@dataclass(frozen=True)
class Killed:
    """What was killed, when the kill began and when the process was gone (monotonic)."""

    what: str
    at: float
    gone: float


class Load:
    """CLIENTS threads sending short chat requests to every model in turn until the `with`
    ends; each request's outcome is kept."""

    def __init__(self, cluster: Cluster, models: Sequence[str]) -> None:
        self.base_url = cluster.base_url
        self.api_key = cluster.api_key
        self.models = models
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(i,)) for i in range(CLIENTS)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _send(self, first: int) -> None:
        with openai.OpenAI(
            base_url=self.base_url, api_key=self.api_key, timeout=HANG_S, max_retries=0
        ) as client:
            turn = first
            while not self._stop.is_set():
                model = self.models[turn % len(self.models)]
                turn += 1
                sent = time.monotonic()
                result, message = _ask(client, model)
                ended = time.monotonic()
                with self._lock:
                    self.outcomes.append(Outcome(model, sent, ended, result, message))
                self._stop.wait(max(0.0, PERIOD_S - (ended - sent)))

    def seen(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def served_again(self, since: float) -> float | None:
        """When every model had answered a request sent at `since` or later (None: not yet)."""
        served = {o.model: o.ended for o in reversed(self.seen()) if o.ok and o.sent >= since}
        return max(served.values()) if len(served) == len(self.models) else None


def _ask(client: openai.OpenAI, model: str) -> tuple[str, str]:
    """How one short chat request ended, and the error's message."""
    try:
        answer = client.chat.completions.create(model=model, messages=HI, max_tokens=4)
    except openai.APITimeoutError as exc:
        return "hang", str(exc)
    except openai.APIConnectionError as exc:
        return "connection", str(exc)
    except openai.APIStatusError as exc:
        return f"{exc.status_code} {exc.code}", str(exc)
    return ("ok" if answer.choices[0].message.content else "empty answer"), ""


# Which failed requests, of those that ended after the kill began, the kill explains:
# (the outcome, the kill, when service was back).
MayFail = Callable[[Outcome, Killed, float], bool]


def in_flight(outcome: Outcome, killed: Killed, back: float) -> bool:
    """Sent before the killed process was gone: it may have been serving the request."""
    return outcome.sent <= killed.gone


def before_back(outcome: Outcome, killed: Killed, back: float) -> bool:
    """In flight at the kill, or sent before service was back (every model answered again)."""
    return outcome.sent <= back


def nothing(outcome: Outcome, killed: Killed, back: float) -> bool:
    """The killed process serves no request: nothing may fail."""
    return False


def chaos(
    cluster: Cluster, kill: Callable[[], Killed], may_fail: MayFail, bound: float = RECOVERY_S
) -> None:
    """Kill under load, wait for service to come back, stop the load, and check the role."""
    declared = set(cluster.declared())
    wait_for(
        lambda: cluster.role.healthy() and not engine_problems(cluster, declared),
        timeout=60,
        what="a healthy role with every engine ready before the kill",
    )
    with Load(cluster, sorted(declared)) as load:
        time.sleep(BEFORE_S)
        killed = kill()
        served, healthy = recovery(cluster, load, killed, bound)
        time.sleep(AFTER_S)
    outcomes = load.seen()
    back = killed.gone + (served if served is not None else bound)
    unexplained = [
        o for o in outcomes if not o.ok and not (o.ended >= killed.at and may_fail(o, killed, back))
    ]
    report(killed.what, outcomes, served, healthy)
    assert served is not None, f"a model did not answer within {bound} s: {failures(outcomes)}"
    assert healthy is not None, f"capyctl status not healthy within {bound} s"
    assert not [o for o in outcomes if o.result == "hang"], f"hangs: {failures(outcomes)}"
    assert not unexplained, f"failures the kill does not explain: {failures(unexplained)}"
    check_after(cluster, declared)


def recovery(
    cluster: Cluster, load: Load, killed: Killed, bound: float
) -> tuple[float | None, float | None]:
    """Seconds from the process's end until every model answered a request sent after it,
    and until `capyctl status` was healthy (None: not within `bound`)."""
    found: dict[str, float] = {}

    def both() -> bool:
        if "served" not in found and (at := load.served_again(killed.gone)) is not None:
            found["served"] = at - killed.gone
        if "healthy" not in found and cluster.role.healthy():
            found["healthy"] = time.monotonic() - killed.gone
        return len(found) == 2

    poll(both, timeout=bound - (time.monotonic() - killed.gone))
    return found.get("served"), found.get("healthy")


def report(what: str, outcomes: list[Outcome], served: float | None, healthy: float | None) -> None:
    """One line for the closing note: the kill, the requests and the recovery."""
    failed = Counter(o.result for o in outcomes if not o.ok)
    ok = sum(o.ok for o in outcomes)
    figure = "never" if served is None else f"{served:.2f} s"
    status = "never" if healthy is None else f"{healthy:.2f} s"
    print(
        f"chaos: killed {what}: sent {len(outcomes)}, succeeded {ok}, failed "
        f"{dict(sorted(failed.items())) or 0}; both models answered {figure} after the kill, "
        f"status healthy after {status}"
    )


def failures(outcomes: Iterable[Outcome]) -> list[str]:
    """Each way requests failed, with its count and the message of its first."""
    found: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        if not o.ok:
            found.setdefault((o.model, o.result), []).append(o)
    return [
        f"{len(same)} x {model} {result}: {same[0].message}"
        for (model, result), same in found.items()
    ]


def check_after(cluster: Cluster, declared: set[str]) -> None:
    """The deployments, engines and places once the load has stopped."""
    assert set(cluster.declared()) == declared, "a declared deployment was lost"
    listed = json.loads(cluster.ok("list", "deployments", "--json"))
    assert {row["name"] for row in listed} == declared, listed
    problems = settled(lambda: engine_problems(cluster, declared))
    assert not problems, f"engines after {SETTLE_S} s: {problems}"
    held = settled(lambda: places_held(cluster, declared))
    assert not held, f"places held {SETTLE_S} s after the load stopped: {held}"


def settled(problems: Callable[[], list[str]]) -> list[str]:
    """The problems still found after SETTLE_S, or none as soon as there are none."""
    if poll(lambda: not problems(), SETTLE_S, interval=0.2):
        return []
    return problems()


def engine_groups(cluster: Cluster) -> dict[int, list[int]]:
    """Every engine process of this role, by process group: an engine's programs run from
    the role's engine installs, and the simulated engine core names the role's GPUs."""
    marks = (f"{cluster.root}/e/", f"{cluster.role.state_dir}/simgpu")
    found = live_processes()
    groups = {p.pgid for p in found if any(mark in p.cmdline for mark in marks)}
    return {pgid: [p.pid for p in found if p.pgid == pgid] for pgid in groups}


def engine_problems(cluster: Cluster, declared: Iterable[str]) -> list[str]:
    """Engine processes no live instance record counts (an orphan, or a deployment's second
    group), instances not ready or whose engine is gone, and engine log writers left
    behind by an engine that is gone."""
    records = {name: cluster.instance(name) for name in declared}
    live = {name: r for name, r in records.items() if r is not None and r.state in LIVE_STATES}
    owners = {r.process.pgid: name for name, r in live.items() if r.process is not None}
    groups = engine_groups(cluster)
    problems = [
        f"engine group {pgid} (pids {pids}) belongs to no instance record"
        for pgid, pids in groups.items()
        if pgid not in owners
    ]
    for name, record in records.items():
        if record is None or record.state != InstanceState.READY or record.process is None:
            problems.append(f"{name} is {record.state if record else 'without a record'}")
        elif not pid_alive(record.process.pid):
            problems.append(f"{name}'s engine (pid {record.process.pid}) is gone while ready")
    logs = {r.log_path for r in live.values()}
    for pid in processes_mentioning(f"{cluster.role.state_dir}/logs/engines/"):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue  # gone meanwhile
        if logs.isdisjoint(argv):
            problems.append(f"log writer {pid} outlived its engine")
    return problems


def places_held(cluster: Cluster, declared: Iterable[str]) -> list[str]:
    """Places Redis counts as taken, and the router's gauge of requests holding one."""
    held = [
        f"{name}: {found.running} in Redis"
        for name in declared
        if (found := cluster.places(name)).running
    ]
    metrics = httpx.get(
        f"http://{cluster.role.inference}/metrics",
        headers={"Authorization": f"Bearer {cluster.api_key}"},
        timeout=10,
    ).text
    gauges = [line for line in metrics.splitlines() if line.startswith("capyctl_requests_running{")]
    held += [line for line in gauges if float(line.rsplit(" ", 1)[1]) != 0]
    return held


def kill(name: str, pid: int) -> Killed:
    """SIGKILL `pid` and wait until it is gone (its sockets closed)."""
    at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), timeout=10, what=f"{name} to die", interval=0.005)
    return Killed(f"{name} (pid {pid})", at, time.monotonic())


def kill_process(cluster: Cluster, name: str) -> Callable[[], Killed]:
    return lambda: kill(name, cluster.role.processes()[name]["pid"])


def routers(cluster: Cluster) -> list[tuple[str, int]]:
    """The processes that serve inference requests, whatever they are called: the router's
    workers where it runs several, else the router processes themselves."""
    found = []
    for process in cluster.role.status()["processes"]:
        if process["name"].startswith("router"):
            workers = process.get("workers") or [process]
            found += [(w["name"], w["pid"]) for w in workers if w["state"] == "RUNNING"]
    return found


def test_a_killed_router_worker_loses_only_its_own_requests(two_models: Cluster) -> None:
    """One of the processes that serve requests is killed: the others on the same listener
    take every new request, so only those in flight on it may fail."""

    def kill_one() -> Killed:
        serving = routers(two_models)
        assert len(serving) > 1, f"several router processes serve requests: {serving}"
        return kill(*serving[-1])

    chaos(two_models, kill_one, in_flight)


def test_a_killed_scheduler_fails_no_request(two_models: Cluster) -> None:
    chaos(two_models, kill_process(two_models, "scheduler"), nothing)


def test_a_killed_memwatch_fails_no_request(two_models: Cluster) -> None:
    chaos(two_models, kill_process(two_models, "memwatch"), nothing)


def test_a_killed_redis_fails_only_requests_in_flight(two_models: Cluster) -> None:
    """supervisord starts Redis again from its append-only file at once; a request sent
    meanwhile waits for it (for 2 s, then answers 503 redis_unreachable, which says so)."""

    def said(outcome: Outcome, killed: Killed, back: float) -> bool:
        outage = outcome.result == "503 redis_unreachable" and before_back(outcome, killed, back)
        return outage or in_flight(outcome, killed, back)

    chaos(two_models, kill_process(two_models, "redis"), said)


@pytest.mark.parametrize("name", ["alpha", "beta"], ids=["vllm", "sglang"])
def test_a_killed_engine_fails_only_its_own_requests(two_models: Cluster, name: str) -> None:
    """An engine's leader is killed (vLLM's engine core stays, as it does when its parent
    dies): only that model's requests may fail, each with an answer saying so. Run before
    hostd is killed: this engine is one hostd started (see the re-adopted case)."""
    leader = engine_leader(two_models, name)
    hostd = two_models.role.processes()["hostd"]["pid"]
    assert parent(leader) == hostd, "the engine is hostd's own child"
    chaos(two_models, lambda: kill(f"{name}'s engine", leader), its_own(name))
    assert engine_leader(two_models, name) != leader, "the engine was started again"


def test_a_killed_hostd_fails_no_request_and_re_adopts_the_engines(two_models: Cluster) -> None:
    before = engine_leaders(two_models)
    chaos(two_models, kill_process(two_models, "hostd"), nothing)
    assert engine_leaders(two_models) == before, "every engine re-adopted as it ran"


def test_a_role_restart_under_load_re_adopts_every_engine(two_models: Cluster) -> None:
    """The role is stopped (SIGTERM) and started again on the same listeners: requests fail
    while no router listens, and every engine is re-adopted as it ran (same PIDs)."""
    before = engine_leaders(two_models)

    def restart() -> Killed:
        at = time.monotonic()
        assert two_models.role.stop() == 0, two_models.role.output()
        stopped = Killed("the whole role (stopped, then started again)", at, time.monotonic())
        two_models.start_again()
        return stopped

    chaos(two_models, restart, before_back, ROLE_RECOVERY_S)
    assert engine_leaders(two_models) == before, "every engine re-adopted as it ran"


def test_a_killed_re_adopted_engine_fails_only_its_own_requests(two_models: Cluster) -> None:
    """As the engine kill above, once hostd was restarted: the engine is not its child."""
    kill_process(two_models, "hostd")()
    wait_for(two_models.role.healthy, timeout=RECOVERY_S, what="hostd back")
    leader = engine_leader(two_models, "alpha")
    assert parent(leader) != two_models.role.processes()["hostd"]["pid"], "re-adopted"
    chaos(two_models, lambda: kill("alpha's re-adopted engine", leader), its_own("alpha"))


def its_own(name: str) -> MayFail:
    """An engine kill's failures: requests for its deployment, sent before service was
    back, that the router answered with an error saying the engine failed or the model was
    unavailable."""

    def may_fail(outcome: Outcome, killed: Killed, back: float) -> bool:
        said = outcome.result in ("500 engine_error", "503 unavailable")
        return outcome.model == name and said and before_back(outcome, killed, back)

    return may_fail


def engine_leader(cluster: Cluster, name: str) -> int:
    record = cluster.instance(name)
    assert record is not None
    assert record.process is not None
    return record.process.pid


def engine_leaders(cluster: Cluster) -> dict[str, int]:
    """Each deployment's engine leader, as its instance record names it."""
    return {name: engine_leader(cluster, name) for name in cluster.declared()}


def parent(pid: int) -> int:
    return next(p.ppid for p in live_processes() if p.pid == pid)
