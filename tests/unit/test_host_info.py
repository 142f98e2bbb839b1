"""What a host says of itself: its release and capabilities, read as data never trusted."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from capycommon.domain.hosts import HOST_CAPABILITIES, STARTUP_HOST_BYTES, HostInfo


def test_a_host_of_an_earlier_release_names_no_release_and_no_capability() -> None:
    info = HostInfo.model_validate_json('{"deep_park": true, "lmcache": true}')
    assert (info.version, info.capabilities) == (None, ())


def test_this_release_names_the_capabilities_the_server_gates_on() -> None:
    assert STARTUP_HOST_BYTES in HOST_CAPABILITIES
    info = HostInfo(version="0.1.0", capabilities=HOST_CAPABILITIES)
    assert HostInfo.model_validate_json(info.model_dump_json()) == info


@pytest.mark.parametrize(
    "capabilities",
    [["Startup Host Bytes"], ["x" * 65], [""], ["a"] * 65, "startup_host_bytes", [7]],
)
def test_a_malformed_capability_list_is_refused(capabilities: object) -> None:
    with pytest.raises(ValidationError):
        HostInfo.model_validate({"capabilities": capabilities})
