"""A host's settings (`host.*`): its name, where its models are, the ports and controls of
its engines, simulated GPUs; a joined host's ingress; and a server's own embedded host.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from capycommon.domain.strict import Strict
from capycommon.settingnames import Setting, setting
from capycommon.settingvalues import (
    DialAddress,
    HostName,
    ListenAddress,
    OnOff,
    PortRange,
    SimulatedGpus,
    Size,
)


def machine_host_name(hostname: str | None = None) -> str:
    """This machine's hostname made a host name: its first label, lower-cased, each run of
    other characters a hyphen, at most 63 characters; `local` if nothing is left."""
    label = (socket.gethostname() if hostname is None else hostname).split(".")[0].lower()
    name = re.sub(r"[^a-z0-9-]+", "-", label).strip("-")[:63].rstrip("-")
    return name or "local"


def _short(flag: str, *, metavar: str = "", empty_refused: bool = True) -> Setting:
    """The short names a host setting keeps beside its derived ones: the flag `--<flag>` and
    the variable CAPYCTL_<FLAG>; an empty variable is refused unless told otherwise."""
    variable = "CAPYCTL_" + flag.upper().replace("-", "_")
    return Setting(
        flags=(f"--{flag}",), variables=(variable,), metavar=metavar, empty_refused=empty_refused
    )


class HostSection(Strict):
    name: HostName = Field(
        default_factory=machine_host_name,
        description="This host's name; the state dir keeps the name of its first start.",
        examples=["gpu-box"],
    )
    models_root: Annotated[
        Path, AfterValidator(lambda p: p.expanduser()), _short("models-root", empty_refused=False)
    ] = Field(
        default_factory=lambda: Path.home() / "models",
        description="The folder that model names in deployments are relative to.",
        examples=["/srv/models"],
    )
    engine_ports: Annotated[PortRange, _short("engine-ports", metavar="START-END")] = setting(
        "8100-8199", "The loopback ports engines listen on.", "8200-8299"
    )
    deep_park: Annotated[OnOff, _short("deep-park")] = setting(
        "on",
        (
            "off: no engine here parks deep or runs with its development controls "
            "(vLLM's dev mode); models that would park deep stop instead."
        ),
        "off",
    )
    engine_telemetry: Annotated[Literal["off", "allow"], _short("engine-telemetry")] = setting(
        "off",
        (
            "off: every engine here gets DO_NOT_TRACK=1 (vLLM also VLLM_DO_NOT_TRACK=1 "
            "and VLLM_NO_USAGE_STATS=1), so none reports usage off the host; allow: the engines' "
            "own defaults."
        ),
        "allow",
    )
    retention: Annotated[Literal["default", "zero"], _short("retention")] = setting(
        "default",
        (
            "zero: engines here keep no log and write no core dump, unless a "
            "deployment says retention: default."
        ),
        "zero",
    )
    lmcache: Annotated[Literal["auto", "off"], _short("lmcache")] = setting(
        "auto",
        (
            "off: no model here runs with LMCache, whatever its deployment says (one "
            "that says lmcache: required fails here)."
        ),
        "off",
    )
    simulated_gpus: Annotated[
        SimulatedGpus,
        Setting(variables=("CAPYCTL_SIMULATED_GPUS",), metavar="NAME:SIZE,..."),
    ] = setting(
        None,
        "Simulated GPUs instead of NVML: gpu0:24GiB,gpu1:24GiB or unified:128GiB.",
        "gpu0:24GiB",
    )
    simulated_host_ram: Annotated[
        Size,
        Setting(variables=("CAPYCTL_SIMULATED_HOST_RAM",), metavar="SIZE"),
    ] = setting(None, "Simulated host RAM, e.g. 64GiB (with simulated GPUs only).", "64GiB")
    simgpu_dir: Annotated[Path | None, Setting(variables=("CAPYCTL_SIMGPU_DIR",))] = setting(
        None,
        "Where simulated GPUs keep devices.json and the claims; none: <state>/simgpu.",
        "/srv/capyctl/simgpu",
    )


class IngressSection(Strict):
    """A joined host's ingress: where the server's router reaches this host's engines, over
    mutual TLS (`capycommon.ingress`)."""

    bind: ListenAddress = setting(
        "0.0.0.0:8444",
        (
            "Where this joined host's ingress listens for the server's router (mutual "
            "TLS); only the server needs to reach it."
        ),
        "100.64.0.21:8444",
    )
    address: DialAddress = setting(
        None,
        (
            "The HOST:PORT the server's router dials for the ingress (none: bind; on "
            "every interface, this machine's hostname)."
        ),
        "gpu-box.lan:8444",
    )


class JoinedHostSection(HostSection):
    """The host role's host settings: a standalone role's, and its ingress once joined."""

    ingress: IngressSection = IngressSection()


class EmbeddedHostSection(HostSection):
    """A server's own host: with `embedded: on` the server also runs hostd and memwatch, and
    serves models on this machine's GPUs beside those of its joined hosts."""

    embedded: Annotated[OnOff, _short("embedded-host")] = setting(
        "off",
        (
            "on: this server is also a host, as a standalone role is (its models run "
            "here too, beside those of joined hosts); the other host settings apply only then."
        ),
        "on",
    )
