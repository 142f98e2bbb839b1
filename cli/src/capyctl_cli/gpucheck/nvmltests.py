"""Step 2: the NVML-gated tests (tests/integration/memwatch/test_memwatch_nvml.py), run by
pytest from a clone. They pass only on a real GPU; elsewhere they skip, and so does this step,
with their reason. A release executable carries neither tests nor pytest: SKIP, naming where
to run them from."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from xml.etree import ElementTree

from capyctl_cli.gpucheck.machine import NVML_TESTS
from capyctl_cli.gpucheck.report import Fail, Skip

GATED = "test_real_"  # the tests that read the real driver
TIMEOUT_S = 240.0


def outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """Each test's outcome in a JUnit report, (passed | skipped | failed, message)."""
    found: dict[str, tuple[str, str]] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):  # noqa: S314 - our own
        name = case.get("name", "")
        outcome, message = "passed", ""
        for kind in ("skipped", "failure", "error"):
            element = case.find(kind)
            if element is not None:
                outcome = "skipped" if kind == "skipped" else "failed"
                message = element.get("message", "")
                break
        found[name] = (outcome, message)
    return found


def run(root: Path, report: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pytest", str(root / NVML_TESTS), "-q", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*argv, f"--junitxml={report}"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def check(root: Path | None) -> str:
    if root is None:
        raise Skip(
            "a release executable carries no tests: run scripts/gpu-check from a clone "
            "(after scripts/setup) for them"
        )
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        report = Path(folder) / "report.xml"
        done = run(root, report)
        if not report.is_file():
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            raise Fail(f"pytest exited {done.returncode} without a report: {' | '.join(tail)}")
        found = outcomes(report)
    failed = [name for name, (outcome, _) in found.items() if outcome == "failed"]
    if failed:
        raise Fail(f"{len(failed)} failed: {', '.join(failed)} (pytest {NVML_TESTS})")
    gated = {name: result for name, result in found.items() if name.startswith(GATED)}
    others = len(found) - len(gated)
    if not gated:
        raise Fail(f"{NVML_TESTS} holds no {GATED}* test")
    skipped = [message for outcome, message in gated.values() if outcome == "skipped"]
    if skipped:
        raise Skip(
            f"the {len(gated)} NVML-gated tests skipped ({skipped[0]}); the {others} others passed"
        )
    return f"the {len(gated)} NVML-gated tests passed on the real device, and {others} others"
