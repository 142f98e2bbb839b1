"""Installs of simulated engines that look real to whoever inspects them.

`install_python_engine` makes a venv holding a real `vllm` or `sglang` wheel (dist-info,
RECORD with hashes, console script) whose modules hand over to this simulator.
`install_llama_server` writes an executable `llama-server`. The behaviour document sits
next to the code (`<package>/_capyctl_sim.json`, `llama-server.sim.json`); it is written after
pip installs the wheel, so it is not in RECORD and rewriting it (`write_behaviour`) leaves
the install's recorded files, and so CapyCTL's fingerprint of it, unchanged.
"""

from __future__ import annotations

import base64
import hashlib
import site
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Literal

from enginesim.behaviour import Behaviour, save_behaviour

PythonFamily = Literal["vllm", "sglang"]
BEHAVIOUR_FILE = "_capyctl_sim.json"
LLAMA_BEHAVIOUR_SUFFIX = ".sim.json"

_SHIM = '''"""Simulated {family} {version}: hands over to enginesim."""

import sys
from pathlib import Path

from enginesim.launch import run

BEHAVIOUR = Path(__file__).resolve().parents[{depth}] / "{behaviour}"


def main() -> int:
    return run("{form}", "{version}", sys.argv[1:], BEHAVIOUR)


if __name__ == "__main__":
    raise SystemExit(main())
'''

# family -> (module path, launch form, depth below the package folder)
_ENTRY_MODULES: dict[PythonFamily, list[tuple[str, str, int]]] = {
    "vllm": [
        ("vllm/entrypoints/openai/api_server.py", "vllm-api-server", 2),
        ("vllm/entrypoints/cli/main.py", "vllm-cli", 2),
    ],
    "sglang": [
        ("sglang/launch_server.py", "sglang-launch-server", 0),
        ("sglang/cli/main.py", "sglang-cli", 1),
    ],
}
_CONSOLE_SCRIPTS: dict[PythonFamily, str] = {
    "vllm": "vllm = vllm.entrypoints.cli.main:main",
    "sglang": "sglang = sglang.cli.main:main",
}


def _package_files(family: PythonFamily, version: str) -> dict[str, str]:
    files = {f"{family}/__init__.py": f'__version__ = "{version}"\n'}
    for path, form, depth in _ENTRY_MODULES[family]:
        parts = path.split("/")
        for end in range(1, len(parts) - 1):
            files.setdefault("/".join(parts[: end + 1]) + "/__init__.py", "")
        files[path] = _SHIM.format(
            family=family, version=version, depth=depth, behaviour=BEHAVIOUR_FILE, form=form
        )
    return files


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(family: PythonFamily, version: str, folder: Path) -> Path:
    """A real wheel named `family` at `version` holding the shims."""
    dist_info = f"{family}-{version}.dist-info"
    files = _package_files(family, version)
    files[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {family}\nVersion: {version}\n"
        f"Summary: Simulated {family} (enginesim)\n"
    )
    files[f"{dist_info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: enginesim\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files[f"{dist_info}/entry_points.txt"] = f"[console_scripts]\n{_CONSOLE_SCRIPTS[family]}\n"
    records = [_record_line(name, text.encode()) for name, text in files.items()]
    records.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = "\n".join(records) + "\n"
    wheel = folder / f"{family}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return wheel


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise FileNotFoundError(f"{venv} has no lib/python3*/site-packages")
    return found[0]


def _link_this_environment(venv: Path) -> None:
    """Make this interpreter's packages (capycommon, fastapi, uvicorn) importable there."""
    lines = [f"import site; site.addsitedir({str(d)!r})\n" for d in site.getsitepackages()]
    (_site_packages(venv) / "_capyctl_enginesim.pth").write_text("".join(lines))


def install_python_engine(
    venv: Path,
    family: PythonFamily,
    version: str,
    behaviour: Behaviour | None = None,
) -> Path:
    """Create `venv` with a simulated `family` at `version` installed by pip; returns `venv`."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    _link_this_environment(venv)
    with tempfile.TemporaryDirectory(prefix="enginesim-wheel-") as folder:
        wheel = build_wheel(family, version, Path(folder))
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(venv / "bin" / "python"),
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--no-index",
                str(wheel),
            ],
            check=True,
        )
    write_behaviour(venv, behaviour or Behaviour())
    return venv


def install_llama_server(folder: Path, build: int, behaviour: Behaviour | None = None) -> Path:
    """Write an executable `folder/llama-server` of `build`; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    executable = folder / "llama-server"
    executable.write_text(
        f"#!{sys.executable}\n"
        f'"""Simulated llama-server build {build} (enginesim)."""\n'
        "import sys\nfrom pathlib import Path\n\n"
        "from enginesim.launch import run\n\n"
        f'BEHAVIOUR = Path(__file__).resolve().with_name("llama-server{LLAMA_BEHAVIOUR_SUFFIX}")\n'
        f'raise SystemExit(run("llama-server", "{build}", sys.argv[1:], BEHAVIOUR))\n'
    )
    executable.chmod(0o755)
    write_behaviour(executable, behaviour or Behaviour())
    return executable


def behaviour_path(installed: Path) -> Path:
    """Where the behaviour of an install (a venv, or a llama-server executable) lives."""
    if installed.is_file():
        return installed.with_name(installed.name + LLAMA_BEHAVIOUR_SUFFIX)
    packages = _site_packages(installed)
    for family in ("vllm", "sglang"):
        if (packages / family / "__init__.py").is_file():
            return packages / family / BEHAVIOUR_FILE
    raise FileNotFoundError(f"{installed} holds no simulated vllm or sglang")


def write_behaviour(installed: Path, behaviour: Behaviour) -> None:
    """Replace the behaviour of an install; it applies from the next launch."""
    save_behaviour(behaviour_path(installed), behaviour)
