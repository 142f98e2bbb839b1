"""Host RAM from /proc/meminfo and cgroup v2, parsed from fixture trees."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

from capyctl_memwatch.hostram import (
    HostRamReader,
    cgroup_limits,
    parse_meminfo,
    unified_cgroup,
)

GIB = 1 << 30
KIB_PER_GIB = 1 << 20

MEMINFO = f"""MemTotal:       {64 * KIB_PER_GIB} kB
MemFree:        {10 * KIB_PER_GIB} kB
MemAvailable:   {40 * KIB_PER_GIB} kB
Buffers:          123456 kB
HugePages_Total:       0
"""

SLICE = "/user.slice/user-1000.slice/user@1000.service/app.slice/capyctl.scope"


def write_tree(root: Path, cgroup_line: str, limits: dict[str, tuple[str, int]]) -> HostRamReader:
    """A /proc and a /sys/fs/cgroup under `root`: meminfo, self/cgroup, memory.{max,current}."""
    proc, cgroup = root / "proc", root / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(MEMINFO)
    (proc / "self" / "cgroup").write_text(cgroup_line)
    cgroup.mkdir()
    for path, (limit, current) in limits.items():
        folder = cgroup / path.lstrip("/")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "memory.max").write_text(f"{limit}\n")
        (folder / "memory.current").write_text(f"{current}\n")
    return HostRamReader(proc_root=proc, cgroup_root=cgroup)


def test_meminfo_total_and_available() -> None:
    info = parse_meminfo(MEMINFO)
    assert (info.total_bytes, info.available_bytes) == (64 * GIB, 40 * GIB)


def test_meminfo_without_memavailable_falls_back_to_memfree() -> None:
    info = parse_meminfo("MemTotal: 2048 kB\nMemFree: 1024 kB\n")
    assert (info.total_bytes, info.available_bytes) == (2 << 20, 1 << 20)


def test_meminfo_without_total_is_refused() -> None:
    with pytest.raises(ValueError, match="MemTotal"):
        parse_meminfo("MemFree: 1 kB\n")


def test_the_unified_line_is_found_among_v1_lines() -> None:
    text = f"12:memory:/docker/abc\n1:name=systemd:/init.scope\n0::{SLICE}\n"
    assert unified_cgroup(text) == PurePosixPath(SLICE)
    assert unified_cgroup("4:memory:/x\n") is None
    assert unified_cgroup("0::/\n") == PurePosixPath("/")
    assert unified_cgroup("0::/../../other\n") == PurePosixPath("/")


def test_no_cgroup_limit_reads_meminfo(tmp_path: Path) -> None:
    reader = write_tree(tmp_path, "0::/system.slice/x.service\n", {})
    ram = reader.read()
    assert (ram.total_bytes, ram.available_bytes, ram.source) == (64 * GIB, 40 * GIB, "meminfo")


def test_memory_max_of_max_is_no_limit(tmp_path: Path) -> None:
    reader = write_tree(tmp_path, f"0::{SLICE}\n", {SLICE: ("max", 5 * GIB)})
    assert reader.read().source == "meminfo"


def test_a_limit_on_a_path_with_an_at_sign(tmp_path: Path) -> None:
    reader = write_tree(tmp_path, f"0::{SLICE}\n", {SLICE: (str(16 * GIB), 6 * GIB)})
    ram = reader.read()
    assert (ram.total_bytes, ram.available_bytes, ram.source) == (16 * GIB, 10 * GIB, "cgroup")


def test_meminfo_bounds_a_looser_limit(tmp_path: Path) -> None:
    reader = write_tree(tmp_path, f"0::{SLICE}\n", {SLICE: (str(100 * GIB), 1 * GIB)})
    ram = reader.read()
    assert (ram.total_bytes, ram.available_bytes, ram.source) == (64 * GIB, 40 * GIB, "cgroup")


def test_a_parents_limit_binds_the_child(tmp_path: Path) -> None:
    parent = "/user.slice/user-1000.slice/user@1000.service"
    limits = {SLICE: ("max", 2 * GIB), parent: (str(8 * GIB), 5 * GIB)}
    reader = write_tree(tmp_path, f"0::{SLICE}\n", limits)
    ram = reader.read()
    assert (ram.total_bytes, ram.available_bytes) == (8 * GIB, 3 * GIB)
    found = cgroup_limits(reader.cgroup_root, PurePosixPath(SLICE))
    assert [c.path.name for c in found] == ["user@1000.service"]


def test_a_container_sees_its_limit_at_the_cgroup_root(tmp_path: Path) -> None:
    reader = write_tree(tmp_path, "0::/\n", {"/": (str(4 * GIB), 5 * GIB)})
    ram = reader.read()
    assert (ram.total_bytes, ram.available_bytes) == (4 * GIB, 0), "over the limit: none left"


def test_unreadable_limit_files_mean_no_limit(tmp_path: Path) -> None:
    reader = write_tree(tmp_path, f"0::{SLICE}\n", {SLICE: ("garbage", 1)})
    assert reader.read().source == "meminfo"


def test_this_machine() -> None:
    ram = HostRamReader().read()
    assert 0 < ram.available_bytes <= ram.total_bytes
