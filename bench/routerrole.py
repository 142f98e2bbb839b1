"""The role the router bench starts: a standalone role on a simulated GPU, from this clone or
an installed capyctl, with an instant and a paced deployment of the engine simulator as vLLM,
its engines on ports of its own."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import redis.asyncio as aioredis
import yaml

import benchrole
from benchclient import Engine, children
from benchrole import GiB
from capycommon.state.stores import Blocking
from enginesim.behaviour import Behaviour

ANSWER = " ".join(["tok"] * 2000)
INSTANT = Behaviour(load_seconds=0.5, instant=True, answer=ANSWER)


def wait(check: Callable[[], object], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {seconds:.0f} s waiting for {what}")
        time.sleep(0.2)


class Stand:
    """A standalone role on a simulated GPU with the deployments `bench` (instant) and
    `bench-paced` of the simulated vLLM."""

    def __init__(
        self, root: Path, pace: float, streams: int, workers: str, capyctl: list[str], name: str
    ) -> None:
        self.root = root
        self.capyctl = capyctl
        self.name = name
        self.state = root / "state"
        self.env = benchrole.role_env(root)
        router = {"workers": workers if workers == "auto" else int(workers)}
        # Engine ports of its own: other roles on this machine (another of this run's, a
        # test's) lease from the default range, and a direct request would reach theirs.
        ports = random.randrange(20_000, 30_000, 10)
        document = benchrole.write_document(
            root, "64GiB", server={"router": router}, engine_ports=f"{ports}-{ports + 9}"
        )
        paced = INSTANT.model_copy(update={"instant": False, "tokens_per_second": pace})
        for profile, behaviour in (("vllm", INSTANT), ("vllm-paced", paced)):
            benchrole.install_vllm(root, document.parent, profile, behaviour)
        self.inference = f"127.0.0.1:{benchrole.free_port()}"
        self.log = (root / "role.log").open("wb")
        waiting = str(min(4096, max(256, streams)))
        self.role = benchrole.start_standalone(
            self.state,
            document,
            self.inference,
            self.log,
            self.env,
            extra_flags=[
                # One client (this bench) holds every stream of the streams part.
                "--server-listeners-inference-connections-per-client",
                str(streams + 64),
                "--server-routing-max-pending-per-deployment",
                waiting,
                "--server-routing-max-pending-total",
                waiting,
            ],
            new_session=True,
            capyctl=capyctl,
        )
        wait(lambda: self.cli("list", "deployments").returncode == 0, 120, "the role")
        for served, profile in (("bench", "vllm"), ("bench-paced", "vllm-paced")):
            benchrole.sparse_model(root / "models" / served, 2 * GiB)
            deployment = root / f"{served}.yaml"
            deployment.write_text(
                f"name: {served}\nengine: {profile}\nmodel: {served}\n"
                "engine_config: {memory: {request: 6GiB}}\n"
            )
            self.cli("deploy", "model", "--file", str(deployment), "--wait", check=True)
        credentials = yaml.safe_load((self.state / "identity" / "credentials").read_text())
        self.api_key = cast(dict[str, str], credentials)["api_key"]
        self.port = int(self.inference.rsplit(":", 1)[1])
        self.engines = [self.engine("bench"), self.engine("bench-paced")]

    def cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        return benchrole.cli(self.state, self.env, *args, check=check, capyctl=self.capyctl)

    def engine(self, deployment: str) -> Engine:
        path = str(self.state / "redis" / "redis.sock")
        with Blocking(aioredis.Redis(unix_socket_path=path)) as blocking:
            record = blocking(lambda s: s.instances("local").get(deployment, 0))
            secret = blocking(lambda s: s.instances("local").secret(deployment, 0))
        if record is None or record.port is None or record.process is None or not secret:
            raise SystemExit(f"the deployment {deployment} has no serving engine")
        model = record.served_name or deployment
        process = record.process
        return Engine(record.port, secret, model, process.pid, process.pgid)

    def router_pids(self) -> list[int]:
        """The router's parent and its workers, as `capyctl status --json` names them, and any
        other child of the parent /proc shows."""
        found = self.cli("status", "--json")
        try:
            status = json.loads(found.stdout)
        except ValueError:
            raise SystemExit(f"capyctl status --json: {found.stderr or found.stdout}") from None
        pids: set[int] = set()
        for process in status["processes"]:
            if process["name"] == "router" and process["pid"]:
                pids.add(process["pid"])
                pids.update(w["pid"] for w in process.get("workers", []))
                pids.update(children(process["pid"]))
        return sorted(pids)

    def close(self) -> None:
        """Stop both engines (a role's stop leaves them running), then the role; an engine
        still there after a minute is killed with its process group."""
        self.cli("drain", "standalone")

        def running() -> list[Engine]:
            return [engine for engine in self.engines if Path(f"/proc/{engine.pid}").exists()]

        with contextlib.suppress(SystemExit):
            wait(lambda: not running(), 60, "the engines to stop")
        for engine in running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine.pgid, signal.SIGKILL)
        self.role.send_signal(signal.SIGTERM)
        try:
            self.role.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.role.pid, signal.SIGKILL)
            self.role.wait()
        self.log.close()
