"""The GPU check's pure parts: how a step's outcome is said and counted, why torch cannot serve
the engines (naming the fix), the JUnit outcomes of the NVML-gated tests, and which PIDs'
memory is the check's own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from capycommon.errors import InsufficientResources
from capyctl_cli.gpucheck import nvmltests
from capyctl_cli.gpucheck.devicewatch import Gpu, Reading
from capyctl_cli.gpucheck.machine import Torch, TorchSearch, candidates
from capyctl_cli.gpucheck.report import (
    Fail,
    Outcome,
    Skip,
    exit_code,
    run_step,
    spread,
    summary,
)

GiB = 1 << 30
OURS = (sys.version_info[0], sys.version_info[1])


def raises(error: Exception) -> str:
    raise error


def test_each_step_says_pass_fail_or_skip_on_one_line_and_only_a_fail_exits_1() -> None:
    passed = run_step(1, "one", lambda: "20.0 GiB credited")
    skipped = run_step(2, "two", lambda: raises(Skip("no NVIDIA GPU")))
    failed = run_step(3, "three", lambda: raises(Fail("credited 0/3")))
    refused = run_step(4, "four", lambda: raises(InsufficientResources("no room")))
    assert [o.status for o in (passed, skipped, failed, refused)] == [
        "PASS",
        "SKIP",
        "FAIL",
        "FAIL",
    ]
    assert passed.line().startswith("PASS 1 one: 20.0 GiB credited (")
    assert refused.text == "error [insufficient_resources]: no room"
    assert exit_code([passed, skipped]) == 0
    assert exit_code([passed, skipped, failed]) == 1
    assert summary([passed, skipped, failed], 61.2) == "gpu-check: 1 PASS, 1 FAIL, 1 SKIP in 61 s"


def test_a_steps_own_error_is_its_fail_with_the_traceback_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    broken = run_step(5, "five", lambda: raises(KeyError("gpus")))
    assert (broken.status, broken.text) == ("FAIL", "KeyError: 'gpus'")
    assert "Traceback" in capsys.readouterr().err


def test_spreads_read_as_one_figure_when_they_agree() -> None:
    assert spread([1.12, 1.38]) == "1.1-1.4 s"
    assert spread([1.01, 1.04]) == "1.0 s"
    assert spread([0.046, 0.052], "ms", 1000) == "46-52 ms"
    assert Outcome(6, "six", "SKIP", "why", 0.04).line() == "SKIP 6 six: why (0.0 s)"


def torch(python: str, version: tuple[int, int], cuda: bool) -> Torch:
    return Torch(python, "2.6.0+cu124", Path("/site"), version, cuda, "12.4" if cuda else None)


def test_torch_for_the_engines_is_one_this_python_imports_with_a_cuda_device() -> None:
    nothing = TorchSearch((), ("/usr/bin/python3: ModuleNotFoundError: No module named 'torch'",))
    assert nothing.for_engines() is None
    assert nothing.with_cuda() is None
    why = nothing.why_none_for_engines()
    assert why.startswith("no torch here (/usr/bin/python3: ModuleNotFoundError")
    assert "install torch with CUDA for Python" in why
    assert "--python" in why
    cpu = TorchSearch((torch("/usr/bin/python3", OURS, cuda=False),), ())
    assert "sees no CUDA device (a CPU-only build" in cpu.why_none_for_engines()
    other = TorchSearch((torch("/usr/bin/python3.99", (3, 99), cuda=True),), ())
    assert other.with_cuda() is not None, "the attribution step's child can still use it"
    assert other.for_engines() is None
    assert "for Python 3.99 at /usr/bin/python3.99, but capyctl runs on" in (
        other.why_none_for_engines()
    )
    both = TorchSearch((*other.found, torch("/opt/py", OURS, cuda=True)), ())
    assert both.for_engines() == torch("/opt/py", OURS, cuda=True)


def test_the_interpreters_asked_start_with_the_one_given_each_once() -> None:
    asked = candidates(sys.executable)
    assert asked[0] == sys.executable
    assert len(asked) == len(set(asked))
    assert candidates("/opt/torch/bin/python")[:2] == ["/opt/torch/bin/python", sys.executable]


def test_the_gated_tests_outcomes_are_read_from_their_junit_report(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="m" name="test_fake_one"/>'
        '<testcase classname="m" name="test_real_gpus"><skipped message="no GPU"/></testcase>'
        '<testcase classname="m" name="test_real_v2"><failure message="boom"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert nvmltests.outcomes(report) == {
        "test_fake_one": ("passed", ""),
        "test_real_gpus": ("skipped", "no GPU"),
        "test_real_v2": ("failed", "boom"),
    }


def test_a_release_executable_skips_the_tests_saying_where_to_run_them() -> None:
    with pytest.raises(Skip, match="a release executable carries no tests: run scripts/gpu-check"):
        nvmltests.check(None)


def test_ours_is_every_pid_the_first_reading_did_not_credit() -> None:
    def reading(at: float, *gpus: dict[int, int]) -> Reading:
        return Reading(
            at,
            tuple(
                Gpu(i, f"GPU-{i}", "H200", 140 * GiB, sum(p.values()), 0, p)
                for i, p in enumerate(gpus)
            ),
        )

    first = reading(0.0, {10: GiB})
    later = reading(1.0, {10: GiB, 20: 2 * GiB}, {20: GiB, 30: 3 * GiB})
    assert later.apart_from(first.pids()) == {20: 3 * GiB, 30: 3 * GiB}
    assert later.held_by(20) == 3 * GiB
    assert later.held_by(99) is None
    assert later.used == 7 * GiB
