"""Simulated GPUs: the one seam between simulation and the real NVML path.

The contract (docs/architecture.md): `CAPYCTL_SIMULATED_GPUS` names the devices
(`gpu0:24GiB,gpu1:24GiB`, or `unified:128GiB`), and after a `;` how pairs of them connect
(`gpu0-gpu1:nvlink,gpu2-gpu3:switch`; any pair not named is `system`, and with no `;` the
topology is unknown); `<dir>/devices.json` lists them with stable UUIDs; a process claims
memory by writing `<dir>/<pid>.json` as `{"uuid", "bytes", "host_bytes", "also"}` (a
temporary name, then a rename) and removes it on exit. `also` holds the bytes the process
holds on other devices, by UUID (llama.cpp splits a model's layers over every visible GPU
in one process). A device's used memory is the sum over the files of live PIDs.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import cast, get_args

from pydantic import BaseModel, ConfigDict, TypeAdapter

from capycommon.domain.memory import Link
from capycommon.errors import InvalidConfig
from capycommon.units import parse_size

DEVICES_FILE = "devices.json"
_NAMESPACE = uuid.UUID("6d1c1c8e-3a55-4c53-9a77-4b1a0f1d0c11")


class Device(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    index: int
    uuid: str
    name: str
    total_bytes: int
    unified: bool
    # How it connects to each other device, by UUID; empty: unknown.
    links: dict[str, Link] = {}


class Claim(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    uuid: str
    bytes: int
    host_bytes: int = 0
    # Bytes the process holds on other devices, by UUID.
    also: dict[str, int] = {}


_DEVICES = TypeAdapter(list[Device])


def device_uuid(name: str) -> str:
    """Stable for the same name, shaped like NVML's `GPU-<uuid>`."""
    return f"GPU-{uuid.uuid5(_NAMESPACE, name)}"


def parse_devices(spec: str) -> list[Device]:
    """`gpu0:24GiB,gpu1:24GiB` or `unified:128GiB` -> devices, with their links when a
    `;gpu0-gpu1:nvlink,...` follows."""
    listed, sep, topology = spec.partition(";")
    devices = _devices(listed)
    return _linked(devices, topology) if sep else devices


def _devices(spec: str) -> list[Device]:
    devices = []
    for index, item in enumerate(part.strip() for part in spec.split(",") if part.strip()):
        name, sep, size = item.partition(":")
        if not sep or not name:
            raise InvalidConfig(f"CAPYCTL_SIMULATED_GPUS: {item!r} is not NAME:SIZE (gpu0:24GiB)")
        try:
            total = parse_size(size)
        except ValueError as exc:
            raise InvalidConfig(f"CAPYCTL_SIMULATED_GPUS: {exc}") from None
        devices.append(
            Device(
                index=index,
                uuid=device_uuid(name),
                name=name,
                total_bytes=total,
                unified=name == "unified",
            )
        )
    if not devices:
        raise InvalidConfig("CAPYCTL_SIMULATED_GPUS names no device; write e.g. gpu0:24GiB")
    if any(d.unified for d in devices) and len(devices) > 1:
        raise InvalidConfig("CAPYCTL_SIMULATED_GPUS: a unified device must be the only one")
    return devices


def _linked(devices: list[Device], spec: str) -> list[Device]:
    """`devices` with each pair's link: as `spec` names it (`gpu0-gpu1:nvlink,...`), else
    `system`."""
    by_name = {device.name: device for device in devices}
    named: dict[frozenset[str], Link] = {}
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        pair, _, link = item.partition(":")
        first, _, second = pair.partition("-")
        if first not in by_name or second not in by_name or first == second:
            raise InvalidConfig(
                f"CAPYCTL_SIMULATED_GPUS: {item!r} does not name two of its devices "
                f"({', '.join(by_name)}); write e.g. gpu0-gpu1:nvlink"
            )
        if link not in get_args(Link):
            raise InvalidConfig(
                f"CAPYCTL_SIMULATED_GPUS: {item!r}: the link is one of {', '.join(get_args(Link))}"
            )
        named[frozenset((by_name[first].uuid, by_name[second].uuid))] = cast(Link, link)
    return [
        device.model_copy(
            update={
                "links": {
                    other.uuid: named.get(frozenset((device.uuid, other.uuid)), "system")
                    for other in devices
                    if other.uuid != device.uuid
                }
            }
        )
        for device in devices
    ]


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def write_devices(folder: Path, devices: list[Device]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / DEVICES_FILE, [d.model_dump() for d in devices])


def read_devices(folder: Path) -> list[Device]:
    return _DEVICES.validate_json((folder / DEVICES_FILE).read_bytes())


def write_claim(folder: Path, pid: int, claim: Claim) -> None:
    _write_json(folder / f"{pid}.json", claim.model_dump())


def remove_claim(folder: Path, pid: int) -> None:
    (folder / f"{pid}.json").unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (OSError, IndexError):
        return True
    return state != "Z"


@dataclass(frozen=True)
class Usage:
    """What the live claims hold on one device, and per process."""

    used_bytes: int
    host_bytes: int
    by_pid: dict[int, Claim]


def usage(folder: Path) -> dict[str, Usage]:
    """Per device UUID: the sum over the claims of live processes."""
    claims: dict[str, dict[int, Claim]] = {}
    for path in folder.glob("*.json"):
        if not path.stem.isdigit():
            continue
        pid = int(path.stem)
        if not _alive(pid):
            continue
        try:
            claim = Claim.model_validate_json(path.read_bytes())
        except (OSError, ValueError):
            continue  # removed or half-written while we looked
        claims.setdefault(claim.uuid, {})[pid] = claim
        for other, held in claim.also.items():
            if other != claim.uuid:
                claims.setdefault(other, {})[pid] = Claim(uuid=other, bytes=held)
    return {
        device: Usage(
            used_bytes=sum(c.bytes for c in by_pid.values()),
            host_bytes=sum(c.host_bytes for c in by_pid.values()),
            by_pid=by_pid,
        )
        for device, by_pid in claims.items()
    }
