"""hostd reads its command stream from what its predecessor was given but never finished,
then from new commands: the cursor never stays in that history once it is read out."""

from __future__ import annotations

from capycommon.state.streams import Entry
from capyctl_hostd.consumer import next_cursor


def test_the_history_is_read_in_turn_then_new_commands() -> None:
    entries: list[Entry] = [("1-0", {}), ("2-0", {})]
    assert next_cursor("0", entries) == "2-0"
    assert next_cursor("2-0", [("3-0", {})]) == "3-0"
    # Read out after entries (a restart with commands taken but unfinished): new ones now.
    assert next_cursor("3-0", []) == ">"
    assert next_cursor("0", []) == ">"


def test_new_commands_stay_new() -> None:
    assert next_cursor(">", [("9-0", {})]) == ">"
    assert next_cursor(">", []) == ">"
