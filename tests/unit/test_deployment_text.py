"""What `start|park|stop|delete deployment` print: a sentence, then key-value details."""

from __future__ import annotations

import pytest

from capycommon.management import Action, ActionAnswer
from capyctl_cli.deploymenttext import action_summary


def answer(action: Action) -> ActionAnswer:
    return ActionAnswer(operation_id="op-7", deployment="chat", revision=3, action=action)


@pytest.mark.parametrize(
    ("action", "sentence"),
    [
        ("start", "Starting deployment chat."),
        ("park", "Parking deployment chat."),
        ("stop", "Stopping deployment chat."),
    ],
)
def test_a_sent_action_names_what_it_does_and_how_to_follow_it(
    action: Action, sentence: str
) -> None:
    assert action_summary(answer(action)).splitlines() == [
        sentence,
        "deployment  chat",
        f"action      {action}",
        "revision    3",
        "operation   op-7",
        "follow      capyctl status deployment chat",
    ]


def test_a_waited_action_says_the_state_it_reached_and_how_long_it_took() -> None:
    text = action_summary(answer("park"), state="parked", took_s=2.345)
    assert text.splitlines() == [
        "Deployment chat is parked.",
        "deployment  chat",
        "action      park",
        "revision    3",
        "operation   op-7",
        "state       parked",
        "took        2.3 s",
    ]


def test_a_delete_is_never_followed_and_once_waited_for_is_deleted() -> None:
    assert "follow" not in action_summary(answer("delete"))
    assert action_summary(answer("delete"), took_s=1.0).startswith("Deployment chat is deleted.")
