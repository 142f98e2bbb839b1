"""How a client finds the servers' primary Redis: the Sentinels to ask, and as whom."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from capycommon.domain.strict import Strict


def _check_address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT")
    return value


class Topology(Strict):
    # The name the Sentinels monitor the servers' Redis under.
    service: str = Field(pattern=r"^[a-z][a-z0-9-]{0,31}$")
    # Every server's Sentinel, HOST:PORT.
    sentinels: tuple[Annotated[str, AfterValidator(_check_address)], ...] = Field(
        min_length=1, max_length=7
    )
    # The Sentinel user that may only ask where the primary is, and its password.
    user: str = Field(pattern=r"^[a-z][a-z0-9-]{0,63}$")
    password: str = Field(min_length=1, max_length=256, repr=False)

    def addresses(self) -> list[tuple[str, int]]:
        """The Sentinels as (host, port) pairs, as redis-py takes them."""
        found = []
        for address in self.sentinels:
            host, _, port = address.rpartition(":")
            found.append((host.strip("[]"), int(port)))
        return found
