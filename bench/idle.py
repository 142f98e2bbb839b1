"""What a standalone role costs when nothing happens: CPU per process over a quiet window.

Starts a standalone role on a simulated GPU with the engine simulator installed as vLLM and
measures, from /proc/<pid>/stat (utime + stime, and the time of children reaped meanwhile),
the CPU of every process of the role over a window in which nobody asks for anything, twice
in one run:
- the role with no deployments (the baseline);
- the same role with three deployments, each made ready by one request and then parked.
Each process's figure is printed as a share of one core, with the target (all services
together under 1 %). An idle `python -c 'import time; time.sleep(...)'` measured over each
window shows the floor of the measurement itself (0 unless the machine loses ticks).

    .venv/bin/python bench/idle.py [--seconds 60] [--rounds 1]

The engines (the simulator) and their log writers are shown apart from the services.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import httpx
import yaml

import benchrole
from benchrole import GiB
from enginesim.behaviour import Behaviour

TICK = os.sysconf("SC_CLK_TCK")
MODELS = ("idle-a", "idle-b", "idle-c")
# Each model is charged 2 GiB: all three fit ready on the 24 GiB simulated GPU, and parked
# (their 1 GiB of weights kept in host memory) in the host's parked room.
DOCUMENT = (
    "name: {name}\nengine: vllm\nmodel: {name}\nengine_config: {{memory: {{request: 2GiB}}}}\n"
)
BEHAVIOUR = Behaviour(load_seconds=0.5, wake_seconds=0.5, tokens_per_second=10_000)
TARGET = 1.0  # per cent of one core, all services together
SERVICES = ("supervisord", "redis-server", "router", "scheduler", "hostd", "memwatch")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    started: int  # clock ticks after boot: a PID reused is another process
    ticks: int  # utime + stime
    reaped: int  # cutime + cstime: children that ended and were waited for
    argv: tuple[str, ...]


def _read(pid: int) -> Proc | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return Proc(
        pid=pid,
        ppid=int(fields[1]),
        started=int(fields[19]),
        ticks=int(fields[11]) + int(fields[12]),
        reaped=int(fields[13]) + int(fields[14]),
        argv=tuple(arg.decode(errors="replace") for arg in argv if arg),
    )


def _tree(root: int) -> dict[int, Proc]:
    """`root` and every process descending from it."""
    found = {p.pid: p for pid in os.listdir("/proc") if pid.isdigit() and (p := _read(int(pid)))}
    children: dict[int, list[int]] = defaultdict(list)
    for proc in found.values():
        children[proc.ppid].append(proc.pid)
    tree: dict[int, Proc] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in found:
            tree[pid] = found[pid]
            todo.extend(children[pid])
    return tree


def _name(proc: Proc, tree: Mapping[int, Proc], launcher: int) -> str:
    """What a process of the role is, from its command line and its parent's."""
    line = " ".join(proc.argv)
    parent = tree.get(proc.ppid)
    parent_line = " ".join(parent.argv) if parent else ""
    found = Path(proc.argv[0]).name if proc.argv else f"pid {proc.pid}"
    if proc.pid == launcher:
        found = "launcher (capyctl start)"
    elif "capyctl_hostd.logwriter" in line:
        found = "engine log writers"
    elif "capyctl_hostd" in parent_line or (
        parent is not None and _name(parent, tree, launcher) == "engines"
    ):
        found = "engines"  # hostd's children, and theirs (vLLM's engine core)
    elif "redis-server" in line or "supervisord" in line:
        found = "redis-server" if "redis-server" in line else "supervisord"
    else:
        for service in ("router", "scheduler", "hostd", "memwatch"):
            if f"capyctl_{service}" in line or f"capyctl-{service}" in line:
                worker = service == "router" and "capyctl_router" in parent_line
                found = "router worker" if worker else service
    return found


def _spent(before: Mapping[int, Proc], after: Mapping[int, Proc]) -> dict[int, int]:
    """Ticks each process spent between two looks: its own, plus its children's that ended
    meanwhile (less what those had already spent at the first look)."""
    spent: dict[int, int] = {}
    for pid, end in after.items():
        start = before.get(pid)
        if start is None or start.started != end.started:
            spent[pid] = end.ticks  # started within the window
        else:
            spent[pid] = end.ticks - start.ticks + end.reaped - start.reaped
    for pid, first in before.items():
        last = after.get(pid)
        if (last is None or last.started != first.started) and first.ppid in spent:
            spent[first.ppid] -= first.ticks  # its parent's reaped time counts its whole life
    return spent


def measure(
    launcher: int, seconds: float, listing: bool = False
) -> tuple[dict[str, float], dict[str, int], float]:
    """CPU share of one core (%) by kind of process of the role over `seconds`, how many of
    each kind, and an idle sleeper's share over the same window; `listing` prints each
    process's own share."""
    sleeper = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds + 30})"])
    time.sleep(1)  # let its start-up pass: the window measures it asleep
    before = _tree(launcher)
    sleep_before = _read(sleeper.pid)
    start = time.monotonic()
    time.sleep(seconds)
    after = _tree(launcher)
    sleep_after = _read(sleeper.pid)
    elapsed = time.monotonic() - start
    sleeper.kill()
    sleeper.wait()
    shares: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for pid, ticks in _spent(before, after).items():
        kind = _name(after[pid], after, launcher)
        shares[kind] += 100 * ticks / TICK / elapsed
        if listing:
            share = 100 * ticks / TICK / elapsed
            print(f"  {pid:>8} {kind:<24}{share:>8.3f}  {' '.join(after[pid].argv)[:100]}")
        counts[kind] += 1
    assert sleep_before is not None
    assert sleep_after is not None
    floor = 100 * (sleep_after.ticks - sleep_before.ticks) / TICK / elapsed
    return dict(shares), dict(counts), floor


class Stand:
    """A standalone role on one simulated 24 GiB GPU, the simulator registered as vLLM."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = root / "state"
        self.env = benchrole.role_env(root)
        document = benchrole.write_document(root, "128GiB")
        benchrole.install_vllm(root, document.parent, "vllm", BEHAVIOUR)
        for name in MODELS:
            benchrole.sparse_model(root / "models" / name, GiB)
        self.inference = f"127.0.0.1:{benchrole.free_port()}"
        self.log = (root / "role.log").open("wb")
        self.role = benchrole.start_standalone(
            self.state, document, self.inference, self.log, self.env
        )

    def wait_started(self) -> None:
        self._until(lambda: self.cli("list", "deployments").returncode == 0, "the role")

    def cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        return benchrole.cli(self.state, self.env, *args, check=check)

    def park_three(self) -> None:
        """Deploy each model, make it ready with one request, then park it."""
        credentials = yaml.safe_load((self.state / "identity" / "credentials").read_text())
        api_key = cast(dict[str, str], credentials)["api_key"]
        for name in MODELS:
            path = self.root / f"{name}.yaml"
            path.write_text(DOCUMENT.format(name=name))
            self.cli("deploy", "model", "--file", str(path), check=True)
            self._ask(name, api_key)
        for name in MODELS:
            self.cli("park", "deployment", name, "--wait", check=True)
        for name in MODELS:
            shown = self.cli("status", "deployment", name, "--json", check=True).stdout
            states = [instance["state"] for instance in json.loads(shown)["instances"]]
            if states != ["parked"]:
                raise SystemExit(f"{name} is not parked: its instances are {states}")

    def _ask(self, name: str, api_key: str, tries: int = 3) -> None:
        """One chat request to `name` through the router, tried again should the connection
        break (said on stderr: the figures do not depend on it)."""
        for left in reversed(range(tries)):
            try:
                answer = httpx.post(
                    f"http://{self.inference}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {api_key}"},
                    json={"model": name, "messages": [{"role": "user", "content": "hi"}]},
                    timeout=120,
                )
            except httpx.TransportError as exc:
                if not left:
                    raise
                print(f"a request to {name} broke ({exc!r}); asking again", file=sys.stderr)
                continue
            if answer.status_code != 200:
                raise SystemExit(f"a request to {name}: {answer.status_code} {answer.text}")
            return

    @staticmethod
    def _until(check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 180  # a busy machine starts a role slowly
        while not check():
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}")
            time.sleep(0.2)

    def close(self) -> None:
        self.cli("drain", "standalone")
        self._until(
            lambda: (
                not any(
                    _name(p, tree, self.role.pid) == "engines"
                    for tree in [_tree(self.role.pid)]
                    for p in tree.values()
                )
            ),
            "the engines to stop",
        )
        self.role.send_signal(signal.SIGTERM)
        self.role.wait(timeout=60)
        self.log.close()


def _show(
    seconds: float,
    empty: Mapping[str, float],
    parked: Mapping[str, float],
    counts: Mapping[str, int],
    floors: tuple[float, float],
) -> None:
    print(f"CPU over {seconds:g} s, % of one core{'':<8}{'no deployments':>16}{'3 parked':>10}")
    kinds = sorted(
        set(empty) | set(parked), key=lambda k: (k in ("engines", "engine log writers"), k)
    )
    for kind in kinds:
        label = f"{kind} (x{counts[kind]})" if counts.get(kind, 1) > 1 else kind
        print(f"  {label:<40}{empty.get(kind, 0.0):>16.3f}{parked.get(kind, 0.0):>10.3f}")
    services = [k for k in kinds if k not in ("engines", "engine log writers")]
    a = sum(empty.get(k, 0.0) for k in services)
    b = sum(parked.get(k, 0.0) for k in services)
    ratio = f"{b / a:.2f}" if a else "-"
    print(f"  {'the role (all but the engines)':<40}{a:>16.3f}{b:>10.3f}   ratio {ratio}")
    engines = sum(parked.get(k, 0.0) for k in ("engines", "engine log writers"))
    print(f"  {'engines and their log writers':<40}{'':>16}{engines:>10.3f}")
    print(f"  {'an idle sleeping python (the floor)':<40}{floors[0]:>16.3f}{floors[1]:>10.3f}")
    verdict = "met" if b < TARGET else "NOT met"
    print(f"target: the role under {TARGET:g} % of one core with three parked: {verdict}")


def main(seconds: float, rounds: int, listing: bool) -> None:
    root = Path(tempfile.mkdtemp(prefix="capy-idle-"))
    stand = Stand(root)
    try:
        stand.wait_started()
        time.sleep(5)  # the role's own start-up settles
        empties = [measure(stand.role.pid, seconds, listing) for _ in range(rounds)]
        stand.park_three()
        time.sleep(5)  # the parks settle
        parks = [measure(stand.role.pid, seconds, listing) for _ in range(rounds)]
        for (empty, _, floor_a), (parked, counts, floor_b) in zip(empties, parks, strict=True):
            _show(seconds, empty, parked, counts, (floor_a, floor_b))
    finally:
        stand.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="each window (default 60)")
    parser.add_argument("--rounds", type=int, default=1, help="windows of each kind")
    parser.add_argument("--processes", action="store_true", help="list each process too")
    args = parser.parse_args()
    main(args.seconds, args.rounds, args.processes)
