"""The actuator applies every kind of action a plan may return, each through its own handler."""

from __future__ import annotations

from typing import get_args

from capyctl_scheduler.actions import Kind
from capyctl_scheduler.actuator import HANDLERS


def test_every_action_kind_has_a_handler() -> None:
    assert set(HANDLERS) == set(get_args(Kind))


def test_each_kind_is_applied_by_the_handler_of_its_name() -> None:
    assert {kind: handler.__name__ for kind, handler in HANDLERS.items()} == {
        kind: f"_{kind}" for kind in get_args(Kind)
    }
