"""The fleet benchmark's stand (`bench/fleet.py`): a real server role, hosts joined to it as
a real host joins (an invitation each, a key and a certificate of its own, its own Redis
user), and one process running every joined host as a stand-in (`enginesim.standin`) of
8 GPUs of 80 GiB."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import benchrole
import ingressstand
from capycommon import management as wire
from capycommon.engines.families import Family
from capycommon.engines.registry import EngineProfile
from capycommon.joinfile import JoinFile
from capycommon.paths import StatePaths
from capycommon.redistarget import joined_target
from capycommon.service import redis_client
from capycommon.state.stores import State
from capyctl_cli import hosts
from capyctl_cli.management import Management
from enginesim.standin import HostPlan, StandInHost

GiB = 1 << 30
MODELS = {f"m{index}": (8 + index % 5 * 8) * GiB for index in range(20)}  # 8 to 40 GiB
PROFILE = EngineProfile(
    name="vllm",
    family=Family.VLLM,
    version=benchrole.VLLM_VERSION,
    executable=Path("/standin/vllm/bin/python"),
    install_path=Path("/standin/vllm"),
    fingerprint=f"{benchrole.VLLM_VERSION}+sha256:{'0' * 64}",
    verified=True,
    added_at=datetime(2026, 1, 1, tzinfo=UTC),
)


def join(server: ingressstand.Role, root: Path, count: int) -> list[Path]:
    """`count` hosts joined to `server`, each with its state dir in `root`/hosts/<name>."""
    folders = []
    with Management(StatePaths(server.state)) as api:
        for index in range(count):
            name = f"h{index:03d}"
            answer = api.invite(wire.InvitationRequest(host_name=name))
            state = root / "hosts" / name
            state.mkdir(parents=True)
            hosts.join(StatePaths(state), JoinFile.model_validate(answer.join), recover=False)
            folders.append(state)
    return folders


def start_hosts(folders: list[Path], log: Path) -> subprocess.Popen[bytes]:
    """The process running a stand-in for each joined host in `folders`."""
    listing = log.with_suffix(".json")
    listing.write_text(json.dumps([str(folder) for folder in folders]))
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, __file__, str(listing)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


async def _serve(folders: list[Path]) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    clients = [redis_client(joined_target(StatePaths(folder)), connections=4) for folder in folders]
    try:
        async with asyncio.TaskGroup() as group:
            for folder, client in zip(folders, clients, strict=True):
                plan = HostPlan(folder.name, (PROFILE,), models=dict(MODELS))
                group.create_task(StandInHost(State(client), plan).run(stop))
    finally:
        for client in clients:
            await client.aclose()


if __name__ == "__main__":
    asyncio.run(_serve([Path(each) for each in json.loads(Path(sys.argv[1]).read_text())]))
