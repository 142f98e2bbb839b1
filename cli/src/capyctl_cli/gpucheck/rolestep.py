"""Step 3: `capyctl start standalone` on the real GPU: a role in a temporary state dir, on
ports held for it, becomes healthy with memwatch reading the host through NVML (`source
nvml` in its status) and seeing the GPUs the check sees, then stops cleanly."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from capycommon.units import format_size
from capyctl_cli import status
from capyctl_cli.gpucheck.devicewatch import DeviceWatch
from capyctl_cli.gpucheck.report import Fail
from capyctl_cli.gpucheck.role import Role, end_left_under, write_document
from capyctl_cli.status import HostMemory


def describe(host: HostMemory) -> str:
    gpus = ", ".join(f"gpu{g.index} {g.name} {format_size(g.total_bytes)}" for g in host.gpus)
    ram = host.ram
    memory = f"host RAM {format_size(ram.total_bytes)} ({ram.source})" if ram else "no host RAM"
    return f"{gpus or 'no GPU'}; {memory}"


def observed(role: Role, watch: DeviceWatch, backend: str) -> str:
    """What the role's status says of the host, once it says what must hold."""
    (host,) = status.collect(role.paths).hosts
    if host.backend != backend:
        raise Fail(f"memwatch reads the host through {host.backend}, not {backend}")
    seen = sorted(g.uuid for g in host.gpus)
    expected = sorted(g.uuid for g in watch.first.gpus)
    if seen != expected:
        raise Fail(f"the role sees GPUs {seen}, the check {expected}")
    return describe(host)


def check(folder: Path, watch: DeviceWatch, backend: str, env: Mapping[str, str]) -> str:
    write_document(folder)
    role = Role.start(folder, env)
    try:
        figures = observed(role, watch, backend)
    finally:
        stopped = role.stop()
        end_left_under(folder)
    if role.proc.returncode != 0:
        raise Fail(f"the role stopped with exit status {role.proc.returncode}; see {role.log}")
    return f"source {backend}: {figures}; the role stopped in {stopped:.1f} s"
