"""The self-contained executable's entry point (`capyctl_cli.frozen`), run here by this Python
as the executable runs it: `-m`, `-c` and a script as Python would run them, a virtual
environment's packages when called through its `bin/python`, PYTHONPATH unless isolated, and
anything else a capyctl command. tests/release runs the executable itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support import clean_env

# What the executable does with its argv: argv[0] is the name it was called by.
ENTRY = "import sys; sys.argv = sys.argv[1:]; from capyctl_cli.frozen import main; main()"


def frozen(called_as: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-I", "-c", ENTRY, called_as, *args],  # -I: PYTHONPATH is ours
        capture_output=True,
        text=True,
        env=clean_env(**env),
        timeout=60,
        check=False,
    )


def test_a_module_code_and_a_script_run_as_python_runs_them(tmp_path: Path) -> None:
    module = frozen("capyctl", "-m", "platform", "--terse")
    assert module.returncode == 0, module.stderr
    assert module.stdout.strip()
    code = frozen("capyctl", "-I", "-c", "import sys; print(sys.argv)", "a", "b")
    assert code.stdout == "['-c', 'a', 'b']\n", code.stderr
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint('hello', sys.argv[1:])\nsys.exit(3)\n")
    ran = frozen("capyctl", "-u", str(script), "x")
    assert (ran.returncode, ran.stdout) == (3, "hello ['x']\n"), ran.stderr


def test_through_a_venvs_python_its_packages_are_found(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    packages = venv / "lib" / "python3.11" / "site-packages"
    packages.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /nowhere\n")
    (packages / "only_there.py").write_text("print('from the venv')\n")
    found = frozen(str(venv / "bin" / "python"), "-I", "-m", "only_there")
    assert found.stdout == "from the venv\n", found.stderr
    elsewhere = frozen(str(tmp_path / "capyctl"), "-m", "only_there")
    assert "No module named only_there" in elsewhere.stderr


def test_pythonpath_counts_unless_isolated(tmp_path: Path) -> None:
    (tmp_path / "on_path.py").write_text("print('on the path')\n")
    seen = frozen("capyctl", "-m", "on_path", PYTHONPATH=str(tmp_path))
    assert seen.stdout == "on the path\n", seen.stderr
    isolated = frozen("capyctl", "-I", "-m", "on_path", PYTHONPATH=str(tmp_path))
    assert "No module named on_path" in isolated.stderr


def test_anything_else_is_a_capyctl_command() -> None:
    version = frozen("capyctl", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("capyctl ")
    bare = frozen("capyctl", "-I")
    assert bare.returncode == 1
    assert "-I runs a module (-m), code (-c) or a script; name one" in bare.stderr
