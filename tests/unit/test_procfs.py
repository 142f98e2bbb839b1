"""capycommon.procfs on fixture /proc trees: the fields of a stat line, and a walk of /proc
for the members of process groups."""

from __future__ import annotations

import os
from pathlib import Path

from capycommon import procfs


def _process(root: Path, pid: int, comm: str, state: str, pgid: int) -> None:
    folder = root / str(pid)
    folder.mkdir()
    rest = [state, "1", str(pgid), *(["0"] * 16), "4242"]
    (folder / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")


def test_a_stat_line_with_a_command_of_spaces_and_parentheses(tmp_path: Path) -> None:
    _process(tmp_path, 7, "python3 (x) y", "S", 7)
    assert procfs.stat(7, tmp_path) == procfs.StatFields(
        state="S", ppid=1, pgid=7, start_ticks=4242
    )
    assert procfs.stat(8, tmp_path) is None, "a process that is gone"


def test_group_members_are_the_live_processes_of_each_group(tmp_path: Path) -> None:
    _process(tmp_path, 10, "vllm", "S", 10)
    _process(tmp_path, 11, "VLLM::EngineCore", "R", 10)
    _process(tmp_path, 12, "a) 20 (b", "S", 20)  # the command looks like fields
    _process(tmp_path, 13, "gone", "Z", 20)  # a zombie has ended
    _process(tmp_path, 14, "other", "S", 30)
    (tmp_path / "self").mkdir()
    (tmp_path / "15").mkdir()  # ended between the listing and the read
    (tmp_path / "16").mkdir()
    (tmp_path / "16" / "stat").write_text("16 (short")  # not a stat line
    assert procfs.group_members([10, 20, 99], tmp_path) == {10: [10, 11], 20: [12], 99: []}
    assert procfs.group_members([], tmp_path) == {}


def test_this_process_is_in_its_own_group() -> None:
    assert os.getpid() in procfs.group_members([os.getpgid(0)])[os.getpgid(0)]
