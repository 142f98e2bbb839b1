from __future__ import annotations

from capycommon.errorcodes import exit_code_for, http_status_for
from capycommon.errors import CapyError, InvalidConfig, ServicePortInUse


def test_codes_map_to_exit_codes_in_one_place() -> None:
    assert InvalidConfig("x").exit_code == 2
    assert exit_code_for("engine_env_reserved:PATH") == 2
    assert ServicePortInUse("x", code="service_port_in_use:8443").exit_code == 4
    assert exit_code_for("unauthenticated") == 3
    assert exit_code_for("no_such_code") == 13


def test_codes_map_to_http_statuses() -> None:
    assert http_status_for("unknown_model") == 404
    assert http_status_for("queue_full") == 429
    assert CapyError("x").http_status == 500
