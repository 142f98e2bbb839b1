"""What hostd reads of a decision model's files: a GGUF's metadata (its header only, bounded)
and a folder's decision-head files, as the facts a decision deployment resolves against."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from capycommon import gguf
from capyctl_hostd.modelfacts import describe
from decisionmodels import decision_folder, decision_gguf


def test_a_gguf_declares_its_decision_type_in_its_metadata(tmp_path: Path) -> None:
    assert gguf.decision_type(decision_gguf(tmp_path / "d.gguf", "clef", "clef")) == "clef"
    assert gguf.decision_type(decision_gguf(tmp_path / "t.gguf", None)) is None
    keys = [key for key, _ in gguf.pairs(tmp_path / "d.gguf")]
    assert keys[:2] == ["general.architecture", "clef.decision.type"]


def test_what_is_not_a_gguf_file_says_why(tmp_path: Path) -> None:
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(gguf.NotGguf, match="does not begin with GGUF"):
        gguf.decision_type(tmp_path / "fake.gguf")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(gguf.NotGguf, match="cut short"):
        gguf.decision_type(tmp_path / "cut.gguf")
    os.mkfifo(tmp_path / "fifo.gguf")
    with pytest.raises(gguf.NotGguf, match="not a regular file"):
        gguf.decision_type(tmp_path / "fifo.gguf")


def test_a_header_that_claims_too_much_is_read_no_further(tmp_path: Path) -> None:
    pairs = b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 40)
    (tmp_path / "many.gguf").write_bytes(pairs)
    with pytest.raises(gguf.NotGguf, match="metadata pairs"):
        gguf.decision_type(tmp_path / "many.gguf")
    # One string key claiming 1 TiB.
    huge = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 40)
    (tmp_path / "huge.gguf").write_bytes(huge)
    with pytest.raises(gguf.NotGguf, match="a string of"):
        gguf.decision_type(tmp_path / "huge.gguf")


def test_hostd_describes_each_kind_of_decision_head(tmp_path: Path) -> None:
    checkpoint = describe(decision_folder(tmp_path / "pplx", "decision_config")).decision
    assert checkpoint is not None
    assert checkpoint.kind == "decision_config"
    assert checkpoint.evidence == str(tmp_path / "pplx" / "decision_config.json")
    joint = describe(decision_folder(tmp_path / "clef", "joint_head")).decision
    assert joint is not None
    assert joint.kind == "joint_head"
    assert describe(decision_folder(tmp_path / "chat", "none")).decision is None
    laya = describe(decision_gguf(tmp_path / "laya.gguf", "laya")).decision
    assert laya is not None
    assert (laya.kind, laya.type) == ("gguf", "laya")
    assert laya.evidence == f"{tmp_path / 'laya.gguf'}: decision.type laya"
    assert describe(decision_gguf(tmp_path / "plain.gguf", None)).decision is None


def test_a_folder_of_ggufs_is_judged_by_the_one_llamacpp_loads(tmp_path: Path) -> None:
    folder = tmp_path / "kev"
    decision_gguf(folder / "kev-00001-of-00002.gguf", "kev")
    (folder / "kev-00002-of-00002.gguf").write_bytes(b"the second part")
    (folder / "a-stray.gguf").write_bytes(b"not loaded")
    found = describe(folder).decision
    assert found is not None
    assert found.type == "kev"
