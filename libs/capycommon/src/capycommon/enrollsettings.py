"""The server's settings for its joined hosts (`enrollment.*`): where they join and reach
its Redis, how long their invitations and certificates last, and how much of Redis one may
take."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

from capycommon.domain.strict import Strict
from capycommon.settingnames import Setting, setting
from capycommon.settingvalues import DialAddress, ListenAddress, Seconds
from capycommon.units import parse_size

# A host's own keys take a few MiB (its events and commands streams keep 10,000 entries
# each); a quota under this would cut off a host that does nothing wrong.
MIN_HOST_QUOTA = 16 << 20


def _check_quota(value: str) -> str:
    if parse_size(value) < MIN_HOST_QUOTA:
        raise ValueError(f"{value!r} is under 16MiB, less than a host's own keys may need")
    return value


class EnrollmentSection(Strict):
    """How hosts join this server (the bootstrap listener, server TLS) and then reach its
    Redis (its TLS port, mutual TLS with a certificate its authority signed)."""

    control_bind: ListenAddress = setting(
        "0.0.0.0:7445",
        (
            "The server Redis's TLS port for joined hosts; only a client certificate "
            "from this server's authority gets through."
        ),
        "100.64.0.10:7445",
    )
    bootstrap_bind: ListenAddress = setting(
        "127.0.0.1:7444",
        (
            "Where hosts join with an invitation (server TLS); set a LAN or tailnet "
            "address for hosts on other machines."
        ),
        "100.64.0.10:7444",
    )
    control_address: DialAddress = setting(
        None,
        (
            "The HOST:PORT that hosts dial for the TLS port (none: control_bind; on "
            "every interface, this machine's hostname)."
        ),
        "gpu-server.lan:7445",
    )
    bootstrap_address: DialAddress = setting(
        None,
        (
            "The HOST:PORT that hosts join at (none: bootstrap_bind; on every "
            "interface, this machine's hostname)."
        ),
        "gpu-server.lan:7444",
    )
    invitation_ttl: Seconds = setting(
        900.0, "Seconds an invitation may wait for its host to join.", "300", ge=1, le=3600
    )
    certificate_lifetime: Seconds = setting(
        30 * 86400.0,
        "Seconds a host certificate is valid; hosts renew theirs after two thirds.",
        "604800",
        ge=10,
        le=365 * 86400.0,
    )
    host_quota: Annotated[str, AfterValidator(_check_quota), Setting(metavar="SIZE")] = setting(
        "64MiB",
        (
            "The most memory a joined host's keys may take in the server's Redis "
            "(measured every few seconds); a host past it is revoked and its keys dropped."
        ),
        "256MiB",
    )

    @property
    def host_quota_bytes(self) -> int:
        return parse_size(self.host_quota)
