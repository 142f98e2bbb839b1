"""The values settings take: listen addresses, port ranges, idle timeouts, memory limits, and
the rest, each a type that checks itself, with the parsers the services read them with."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from capycommon.errors import InvalidConfig
from capycommon.settingnames import Setting
from capycommon.simgpu import parse_devices
from capycommon.units import parse_duration, parse_size

LOOPBACK_NAMES = frozenset({"localhost"})
# A DNS name: dot-separated labels of letters, digits and inner hyphens, 253 characters at most.
DNS_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


def split_address(value: str) -> tuple[str, int]:
    """`0.0.0.0:8443` -> ("0.0.0.0", 8443); `[::1]:7443` -> ("::1", 7443)."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{value!r} is not ADDR:PORT (for example 0.0.0.0:8443)")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} of {value!r} is outside 1-65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host not in LOOPBACK_NAMES:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"{host!r} in {value!r} is not an IP address (use 0.0.0.0, 127.0.0.1 or [::1])"
            ) from None
    return host, port


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_NAMES or ipaddress.ip_address(host).is_loopback


def _check_address(value: str) -> str:
    split_address(value)
    return value


def check_dial_host(host: str) -> None:
    """A host another machine can dial: an IP address (not a wildcard) or a DNS name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not DNS_NAME.fullmatch(host):
            raise ValueError(f"{host!r} is neither an IP address nor a DNS name") from None
        return
    if ip.is_unspecified:
        raise ValueError(
            f"{host!r} names every interface; give an address hosts can dial, such as the "
            "server's LAN address or DNS name"
        )


def split_dial_address(value: str) -> tuple[str, int]:
    """`gpu-server.lan:7445` -> ("gpu-server.lan", 7445): an address another machine dials,
    a DNS name or an IP address (not a wildcard)."""
    host, sep, port_text = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT (for example gpu-server.lan:7445)")
    check_dial_host(host)
    return host, int(port_text)


def _check_dial_address(value: str | None) -> str | None:
    if value is not None:
        split_dial_address(value)
    return value


def _check_loopback_address(value: str) -> str:
    host, _ = split_address(value)
    if not is_loopback(host):
        raise ValueError(
            f"{value!r} is not a loopback address; the management API listens on loopback "
            "only (for example 127.0.0.1:7443); reach it remotely over ssh"
        )
    return value


def parse_port_range(value: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)-(\d+)", value)
    if not match:
        raise ValueError(f"{value!r} is not START-END (for example 8100-8199)")
    start, end = int(match[1]), int(match[2])
    if not 1024 <= start <= end <= 65535:
        raise ValueError(f"{value!r} must satisfy 1024 <= START <= END <= 65535")
    return start, end


def _check_idle_timeout(value: str) -> str:
    """A duration (`5m`), or `never` to turn the idle step off."""
    if value != "never":
        seconds = parse_duration(value)
        if seconds <= 0:
            raise ValueError(f"{value!r} is no time; give a duration above zero, or never")
    return value


def idle_seconds(value: str) -> float | None:
    """Seconds of an idle timeout, None for `never`."""
    return None if value == "never" else parse_duration(value)


def _check_port_range(value: str) -> str:
    parse_port_range(value)
    return value


def _check_redis_url(value: str | None) -> str | None:
    if value is not None and not value.startswith(("unix://", "redis://", "rediss://")):
        raise ValueError(f"{value!r} is not a redis URL (unix://PATH, redis:// or rediss://)")
    return value


def _check_limit(value: str | None) -> str | None:
    """A limit is a size (24GiB) or a whole percentage of the domain (40%)."""
    if value is None:
        return None
    if value.endswith("%"):
        share = value[:-1]
        if not share.isdigit() or not 0 <= int(share) <= 100:
            raise ValueError(f"{value!r} is not a whole percentage from 0% to 100%")
        return value
    parse_size(value)
    return value


def _check_simulated_gpus(value: str | None) -> str | None:
    if value is not None:
        try:
            parse_devices(value)
        except InvalidConfig as exc:
            raise ValueError(exc.message.removeprefix("CAPYCTL_SIMULATED_GPUS: ")) from None
    return value


def _check_size(value: str | None) -> str | None:
    if value is not None:
        parse_size(value)
    return value


def _on_off(value: object) -> object:
    """YAML reads a bare on/off as a boolean; the setting keeps the word."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    return value


WORKERS_MAX = 64


def _workers(value: object) -> object:
    """A count of router workers, 1 to WORKERS_MAX, or `auto`."""
    if value == "auto":
        return value
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or not 1 <= int(text) <= WORKERS_MAX:
        raise ValueError(
            f"{value!r} is no count of workers; give a whole number from 1 to {WORKERS_MAX}, "
            "or auto"
        )
    return int(text)


ListenAddress = Annotated[str, AfterValidator(_check_address)]
LoopbackAddress = Annotated[str, AfterValidator(_check_loopback_address)]
PortRange = Annotated[str, AfterValidator(_check_port_range)]
IdleTimeout = Annotated[str, AfterValidator(_check_idle_timeout)]
RedisUrl = Annotated[str | None, AfterValidator(_check_redis_url)]
DialAddress = Annotated[
    str | None, AfterValidator(_check_dial_address), Setting(metavar="HOST:PORT")
]
HostName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$"), Setting(metavar="NAME")]
Seconds = Annotated[float, Setting(metavar="SECONDS")]
Limit = Annotated[str | None, AfterValidator(_check_limit), Setting(metavar="SIZE|N%")]
OnOff = Annotated[Literal["on", "off"], BeforeValidator(_on_off)]
Workers = Annotated[int | Literal["auto"], BeforeValidator(_workers), Setting(metavar="N|auto")]
SimulatedGpus = Annotated[str | None, AfterValidator(_check_simulated_gpus)]
Size = Annotated[str | None, AfterValidator(_check_size)]
