"""Every error code: raised in the source, in the code table, and in docs/errors.md, with the
same exit code and HTTP status."""

from __future__ import annotations

import re
from pathlib import Path

from capycommon.errorcodes import CODES, exit_code_for, http_status_for

ROOT = Path(__file__).resolve().parents[2]
# Our sources, not the engine simulator's (libs/enginesim): it speaks the engines' codes.
SOURCES = [ROOT / "libs" / "capycommon" / "src", ROOT / "services", ROOT / "cli" / "src"]
# code = "x", code="x", code=f"x:{...}", error="x" (a refusal's code), and the codes hostd
# records at the head of an instance's error ("wake_mismatch: ...").
RAISED = re.compile(
    r"""(?:\bcode\b\s*(?::\s*ClassVar\[str\]\s*)?=\s*f?|\berror=f?)"([a-z_]+)[:"{]"""
)
RECORDED = re.compile(r"""\bf?"([a-z]+_[a-z_]+): """)
ROW = re.compile(r"^\| `([a-z_]+)` \| (\d+) \| (\d+) \| .+ \|$", re.M)


def raised_codes() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for root in SOURCES:
        for path in root.rglob("*.py"):
            text = path.read_text()
            for code in RAISED.findall(text):
                found.setdefault(code, path)
            if "hostd" in path.parts:
                for code in RECORDED.findall(text):
                    found.setdefault(code, path)
    return found


def documented() -> dict[str, tuple[int, int]]:
    text = (ROOT / "docs" / "errors.md").read_text()
    rows = ROW.findall(text)
    assert rows, "docs/errors.md has no table of codes"
    table = {code: (int(exit_code), int(status)) for code, exit_code, status in rows}
    assert len(table) == len(rows), "a code is listed twice"
    return table


def test_every_code_the_source_raises_is_in_the_table() -> None:
    missing = {code: str(path) for code, path in raised_codes().items() if code not in CODES}
    assert not missing, f"codes without an exit code and HTTP status: {missing}"


def test_the_docs_list_the_table_both_ways() -> None:
    docs = documented()
    assert sorted(set(CODES) - set(docs)) == [], "codes missing from docs/errors.md"
    assert sorted(set(docs) - set(CODES)) == [], "codes in docs/errors.md the code does not know"
    differ = {code: (docs[code], CODES[code]) for code in CODES if docs[code] != CODES[code]}
    assert not differ, f"docs (exit, HTTP) differ from the code: {differ}"


def test_every_code_in_the_table_is_raised_somewhere() -> None:
    unused = sorted(set(CODES) - set(raised_codes()))
    assert unused == [], f"codes nothing raises: drop them or raise them: {unused}"


def test_a_suffixed_code_maps_by_its_stem() -> None:
    assert exit_code_for("engine_env_reserved:PATH") == 2
    assert http_status_for("capability_missing:deep_park") == 409
    assert (exit_code_for("no_such_code"), http_status_for("no_such_code")) == (13, 500)
