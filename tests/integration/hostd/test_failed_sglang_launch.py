"""A failed SGLang launch (its scheduler dies while loading, its HTTP server lives on) fails
within seconds, leaves no process and no /dev/shm segment, ends its log with CapyCTL's
failure line, and prints no Prometheus FileNotFoundError noise."""

from __future__ import annotations

import os
import time
from pathlib import Path

from enginesim import Faults, SchedulerDies, write_behaviour
from integration.hostd.harness import FAST, Hostd, assert_group_gone, launch

SHM = Path("/dev/shm")


def test_a_dead_scheduler_fails_the_launch_at_once_and_leaves_nothing(
    hostd: tuple[Hostd, str], model: Path, installs: dict[str, Path]
) -> None:
    harness, gpu = hostd
    dies = SchedulerDies(after_seconds=1.5, message="RuntimeError: CUDA error: out of memory")
    write_behaviour(
        installs["sglang22"], FAST.model_copy(update={"faults": Faults(scheduler_dies=dies)})
    )
    before = set(os.listdir(SHM))
    started = time.monotonic()
    harness.send(
        launch(
            "a", 1, gpu, model, profile="sglang22", residency="restart_only", start_deadline_s=600
        )
    )
    failed = harness.wait_state("a", "failed", timeout=60)
    took = time.monotonic() - started
    print(f"failed {took:.1f} s after the launch (the scheduler died {dies.after_seconds} s in)")
    assert took < 20, "within seconds, not at the 600 s readiness deadline"
    error = failed.error or ""
    assert "lost its child process" in error
    assert "CUDA error: out of memory" in error, "with the engine's own log lines"
    assert_group_gone(failed)
    assert harness.device_bytes(failed) == (0, 0), "its memory released"
    made = {
        name for name in set(os.listdir(SHM)) - before if name.startswith(("sglang_loads_", "psm_"))
    }
    assert made == set(), "the segments it made, names without a PID included, are removed"
    assert failed.log_path is not None
    text = Path(failed.log_path).read_text()
    print("\n".join(text.splitlines()[-3:]))
    assert "ChildProcessError" in text, "the engine's exit noise is in the log..."
    assert text.splitlines()[-1].startswith("capyctl: launch failed: "), "...before CapyCTL's line"
    assert "FileNotFoundError" not in text, "its children wrote into the launch's own folder"
    assert failed.launch_id is not None
    runtime = harness.state / "runtime" / failed.launch_id
    assert runtime.is_dir()
    assert not (runtime / "prometheus").exists(), "removed once its processes were gone"
