"""Host commands on the wire: the scheduler's reason, and the park's release check."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from capycommon.domain import commands as hc
from capycommon.state import hostcommands
from integration.hostd.harness import launch as hostd_launch

GiB = 1 << 30


def test_every_command_that_changes_state_carries_a_reason() -> None:
    park = hc.Park(deployment="chat", generation=2)
    launch = hostd_launch("chat", 2, "GPU-1", Path("/m"), residency="deep", reason="demanded")
    commands: list[hc.Launch | hc.Park | hc.Wake | hc.Stop] = [
        launch,
        park,
        hc.Wake(deployment="chat", generation=2, reason="demanded"),
        hc.Stop(deployment="chat", generation=2, reason="idle"),
    ]
    assert [c.reason for c in commands] == ["demanded", "requested", "demanded", "idle"]
    for command in commands:
        assert hostcommands.parse(command.model_dump_json()) == command


def test_a_park_names_its_release_bound_or_none() -> None:
    plain = hc.Park(deployment="chat", generation=2)
    assert (plain.release_bound_bytes, plain.verify_s) == (None, 15.0)
    checked = hc.Park(deployment="chat", generation=2, release_bound_bytes=GiB, verify_s=5)
    assert hostcommands.parse(checked.model_dump_json()) == checked
    assert hostcommands.parse('{"kind": "park", "deployment": "chat", "generation": 2}') == plain


@pytest.mark.parametrize(
    ("field", "value"), [("release_bound_bytes", -1), ("verify_s", 0), ("bound_bytes", 1)]
)
def test_a_park_refuses_impossible_or_unknown_fields(field: str, value: int) -> None:
    with pytest.raises(ValidationError, match=field):
        hc.Park.model_validate({"deployment": "chat", "generation": 2, field: value})


def test_a_describe_names_model_paths_and_no_instance() -> None:
    describe = hc.Describe(paths=("/data/qwen", "~/m", "org/name"))
    assert hostcommands.parse(describe.model_dump_json()) == describe
    with pytest.raises(ValidationError, match="deployment"):
        hostcommands.parse('{"kind": "describe", "paths": [], "deployment": "chat"}')
