"""Installs of simulated engines that look real to whoever inspects them.

`install_python_engine` makes a venv holding a real `vllm` or `sglang` wheel (dist-info,
RECORD with hashes, console script) whose modules hand over to this simulator.
`install_lmcache` does the same for `lmcache` (its server module and `lmcache server` hand
over to `enginesim.lmcache`), in a venv of its own or into an engine's venv, as users often
keep both in one. `install_llama_server` writes an executable `llama-server`,
`install_tensorfold` an executable `tensorfold`. The behaviour document sits next to the code
(`<package>/_capyctl_sim.json`, `llama-server.sim.json`, `tensorfold.sim.json`); it
is written after pip installs the wheel, so it is not in RECORD and rewriting it
(`write_behaviour`) leaves the install's recorded files, and so CapyCTL's fingerprint of it,
unchanged.
"""

from __future__ import annotations

import base64
import configparser
import hashlib
import site
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from enginesim.behaviour import Behaviour, LMCacheBehaviour, save_behaviour

PythonFamily = Literal["vllm", "sglang"]
BEHAVIOUR_FILE = "_capyctl_sim.json"
LLAMA_BEHAVIOUR_SUFFIX = ".sim.json"
LINK_FILE = "_capyctl_enginesim.pth"
# After LINK_FILE: Python reads a folder's .pth files in the order of their names.
EXTRA_FILE = "_capyctl_extra.pth"

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


_LMCACHE_SERVER = '''"""Simulated LMCache {version}: its multi-process server, in enginesim."""

import sys
from pathlib import Path

from enginesim.lmcache import run

BEHAVIOUR = Path(__file__).resolve().parents[2] / "{behaviour}"


def main() -> int:
    return run(sys.argv[1:], "{version}", BEHAVIOUR, None)


if __name__ == "__main__":
    raise SystemExit(main())
'''
_LMCACHE_CLI = '''"""Simulated LMCache {version}: the `lmcache` command, in enginesim."""

import sys
from pathlib import Path

from enginesim.lmcache import cli

BEHAVIOUR = Path(__file__).resolve().parent / "{behaviour}"


def main() -> int:
    return cli(sys.argv[1:], "{version}", BEHAVIOUR)


if __name__ == "__main__":
    raise SystemExit(main())
'''
_LMCACHE_CONNECTOR = '"""Simulated LMCache: the module vLLM loads its LMCacheMPConnector from."""\n'


def _lmcache_files(version: str) -> dict[str, str]:
    """The `lmcache` package: its server module, its command, and the module that vLLM's
    `kv_connector_module_path` names (the simulated engines only check it imports)."""
    shim = {"version": version, "behaviour": BEHAVIOUR_FILE}
    return {
        "lmcache/__init__.py": f'__version__ = "{version}"\n',
        "lmcache/cli.py": _LMCACHE_CLI.format(**shim),
        "lmcache/v1/__init__.py": "",
        "lmcache/v1/multiprocess/__init__.py": "",
        "lmcache/v1/multiprocess/http_server.py": _LMCACHE_SERVER.format(**shim),
        "lmcache/integration/__init__.py": "",
        "lmcache/integration/vllm/__init__.py": "",
        "lmcache/integration/vllm/lmcache_mp_connector.py": _LMCACHE_CONNECTOR,
    }


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _wheel(name: str, version: str, package: dict[str, str], script: str, folder: Path) -> Path:
    """A real wheel named `name` at `version` holding `package` and one console script."""
    dist_info = f"{name}-{version}.dist-info"
    files = dict(package)
    files[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        f"Summary: Simulated {name} (enginesim)\n"
    )
    files[f"{dist_info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: enginesim\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files[f"{dist_info}/entry_points.txt"] = f"[console_scripts]\n{script}\n"
    records = [_record_line(path, text.encode()) for path, text in files.items()]
    records.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = "\n".join(records) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def build_wheel(family: PythonFamily, version: str, folder: Path) -> Path:
    """A real wheel named `family` at `version` holding the shims."""
    return _wheel(
        family, version, _package_files(family, version), _CONSOLE_SCRIPTS[family], folder
    )


def build_lmcache_wheel(version: str, folder: Path) -> Path:
    """A real wheel named `lmcache` at `version` holding the shims."""
    script = "lmcache = lmcache.cli:main"
    return _wheel("lmcache", version, _lmcache_files(version), script, folder)


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise FileNotFoundError(f"{venv} has no lib/python3*/site-packages")
    return found[0]


def _link_this_environment(venv: Path) -> None:
    """Make this interpreter's packages (capycommon, fastapi, uvicorn) importable there."""
    lines = [f"import site; site.addsitedir({str(d)!r})\n" for d in site.getsitepackages()]
    (_site_packages(venv) / LINK_FILE).write_text("".join(lines))


def add_packages(venv: Path, folder: Path) -> None:
    """Make the packages in `folder` (another environment's site-packages, say, where torch
    is installed) importable in `venv`, after its own and this interpreter's: a package both
    hold is taken from them."""
    (_site_packages(venv) / EXTRA_FILE).write_text(f"{folder}\n")


def _make_venv(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    _link_this_environment(venv)


def _pip_install(venv: Path, build: Callable[[Path], Path]) -> None:
    """Build a wheel in a scratch folder with `build`, and install it into `venv` by pip (in
    CapyCTL's self-contained executable, which holds no pip, by unpacking it as pip would)."""
    with tempfile.TemporaryDirectory(prefix="enginesim-wheel-") as folder:
        wheel = build(Path(folder))
        if getattr(sys, "frozen", False):
            _unpack(wheel, venv)
            return
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


def _unpack(wheel: Path, venv: Path) -> None:
    """Install a pure-Python wheel into `venv` without pip: its files into site-packages, and
    each console script into bin/, run by the venv's python."""
    packages = _site_packages(venv)
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(packages)
        names = archive.namelist()
    for points in (packages / name for name in names if name.endswith("entry_points.txt")):
        parser = configparser.ConfigParser()
        parser.read(points)
        for script, target in (
            parser.items("console_scripts") if parser.has_section("console_scripts") else []
        ):
            module, _, function = target.partition(":")
            path = venv / "bin" / script
            path.write_text(
                f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom {module} import {function}\n"
                f"sys.exit({function}())\n"
            )
            path.chmod(0o755)


def install_python_engine(
    venv: Path,
    family: PythonFamily,
    version: str,
    behaviour: Behaviour | None = None,
) -> Path:
    """Create `venv` with a simulated `family` at `version` installed by pip; returns `venv`."""
    _make_venv(venv)
    _pip_install(venv, lambda folder: build_wheel(family, version, folder))
    write_behaviour(venv, behaviour or Behaviour())
    return venv


def install_lmcache(
    venv: Path, version: str = "0.5.6", behaviour: LMCacheBehaviour | None = None
) -> Path:
    """Install a simulated `lmcache` at `version` into `venv` by pip, creating `venv` unless
    it is one already (a simulated engine's, say); returns `venv`."""
    if not (venv / "pyvenv.cfg").is_file():
        _make_venv(venv)
    elif not (_site_packages(venv) / LINK_FILE).is_file():
        _link_this_environment(venv)
    _pip_install(venv, lambda folder: build_lmcache_wheel(version, folder))
    write_behaviour(venv, behaviour or LMCacheBehaviour())
    return venv


def _write_executable(folder: Path, name: str, form: str, version: str, title: str) -> Path:
    """An executable `folder/name` that runs `form` at `version` with the behaviour beside it
    (`<name>.sim.json`)."""
    folder.mkdir(parents=True, exist_ok=True)
    executable = folder / name
    executable.write_text(
        f"#!{sys.executable}\n"
        f'"""Simulated {title} (enginesim)."""\n'
        "import sys\nfrom pathlib import Path\n\n"
        "from enginesim.launch import run\n\n"
        f'BEHAVIOUR = Path(__file__).resolve().with_name("{name}{LLAMA_BEHAVIOUR_SUFFIX}")\n'
        f'raise SystemExit(run("{form}", "{version}", sys.argv[1:], BEHAVIOUR))\n'
    )
    executable.chmod(0o755)
    return executable


def install_llama_server(folder: Path, build: int, behaviour: Behaviour | None = None) -> Path:
    """Write an executable `folder/llama-server` of `build`; returns its path."""
    title = f"llama-server build {build}"
    executable = _write_executable(folder, "llama-server", "llama-server", str(build), title)
    write_behaviour(executable, behaviour or Behaviour())
    return executable


def install_tensorfold(folder: Path, version: str, behaviour: Behaviour | None = None) -> Path:
    """Write an executable `folder/tensorfold` at `version` (CapyCTL's assumed TensorFold, see
    `enginesim.tensorfold`), its behaviour in `tensorfold.sim.json` beside it; returns its
    path."""
    title = f"TensorFold {version}"
    executable = _write_executable(folder, "tensorfold", "tensorfold", version, title)
    write_behaviour(executable, behaviour or Behaviour())
    return executable


def behaviour_path(installed: Path) -> Path:
    """Where the behaviour of an install (a venv, or a llama-server or tensorfold
    executable: `<name>.sim.json` beside it) lives."""
    if installed.is_file():
        return installed.with_name(installed.name + LLAMA_BEHAVIOUR_SUFFIX)
    packages = _site_packages(installed)
    for family in ("vllm", "sglang"):
        if (packages / family / "__init__.py").is_file():
            return packages / family / BEHAVIOUR_FILE
    raise FileNotFoundError(f"{installed} holds no simulated vllm or sglang")


def lmcache_behaviour_path(venv: Path) -> Path:
    """Where the behaviour of the simulated LMCache installed in `venv` lives."""
    package = _site_packages(venv) / "lmcache"
    if not (package / "__init__.py").is_file():
        raise FileNotFoundError(f"{venv} holds no simulated lmcache")
    return package / BEHAVIOUR_FILE


def write_behaviour(installed: Path, behaviour: Behaviour | LMCacheBehaviour) -> None:
    """Replace the behaviour of an install, an engine's or, given an `LMCacheBehaviour`, the
    LMCache server's in that venv; it applies from the next launch."""
    if isinstance(behaviour, LMCacheBehaviour):
        save_behaviour(lmcache_behaviour_path(installed), behaviour)
    else:
        save_behaviour(behaviour_path(installed), behaviour)
