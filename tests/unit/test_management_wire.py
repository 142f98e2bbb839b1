"""The management API's wire models: strict for what we send, tolerant for what we read, and
the JSON shapes the scheduler has always answered."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from capycommon.management import (
    ActionRequest,
    Binding,
    DeploymentStatus,
    DeploymentSummary,
    DeployRequest,
    DrainRequest,
    ErrorBody,
    ErrorDetail,
    HostList,
)


def test_a_request_refuses_an_unknown_field_by_name() -> None:
    with pytest.raises(ValidationError, match="expected_revison"):
        DeployRequest.model_validate({"document": {}, "expected_revison": 1})
    with pytest.raises(ValidationError, match="force"):
        ActionRequest.model_validate({"action": "stop", "force": True})
    with pytest.raises(ValidationError, match="action"):
        ActionRequest.model_validate({"action": "restart"})
    assert DrainRequest.model_validate({}).model_dump() == {}


def test_an_answer_ignores_what_a_newer_scheduler_adds() -> None:
    row = DeploymentSummary.model_validate_json(
        '{"name": "a", "state": "idle", "ready": "0/1", "revision": 1, "hosts": [],'
        ' "routes": ["a"], "replicas": 3}'
    )
    assert row.model_dump() == {
        "name": "a",
        "state": "idle",
        "ready": "0/1",
        "revision": 1,
        "hosts": [],
        "routes": ["a"],
        "gpus": [],
    }
    hosts = HostList.model_validate_json('{"api_version": "1", "hosts": [], "zones": []}')
    assert hosts.hosts == []


def test_the_error_body() -> None:
    body = ErrorBody(error=ErrorDetail(code="not_found", message="no such", retryable=False))
    assert body.model_dump(mode="json") == {
        "api_version": "1",
        "error": {"code": "not_found", "message": "no such", "retryable": False, "details": {}},
    }


def test_a_binding_shows_only_what_applies() -> None:
    refused = Binding(host="h")
    refused.deep_park = True
    assert refused.model_dump(mode="json") == {"host": "h", "deep_park": True}
    resolved = Binding(
        host="h",
        engine="vllm",
        model_path="/m",
        weights_bytes=None,
        residency="deep",
        residency_reason="declared",
    )
    dumped = resolved.model_dump(mode="json")
    assert dumped["weights_bytes"] is None, "a figure nobody could measure is null, not absent"
    assert "error" not in dumped
    assert Binding.model_validate(dumped).model_dump(mode="json") == dumped, "read back as sent"


def test_a_status_answer_starts_with_its_version_then_its_summary() -> None:
    fields = list(DeploymentStatus.model_fields)
    assert fields[:8] == ["api_version", *DeploymentSummary.model_fields]
    assert fields[-1] == "document"
