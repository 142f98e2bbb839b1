"""Stand-ins for torch, written where a test's processes import them: the engine simulator's
CUDA mode and scripts/gpu-check call torch, and neither a GPU nor torch is here. Each has CUDA
devices (one, or as many as are visible) and no memory of its own: on simulated GPUs the
claims are the memory."""

from __future__ import annotations

from pathlib import Path

# What each stand-in's `cuda` ends with: the calls that have nothing to do without a GPU.
_CUDA_NO_OPS = """
    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def synchronize():
        return None
"""
# Byte tensors on a device that is a ledger file: with FAKE_TORCH_LEDGER set, each byte
# tensor's size is written, per process, to `<FAKE_TORCH_LEDGER>/<pid>.json` while it lives;
# FAKE_TORCH_DEVICES=0 sees no device.
SOURCE = (
    '''"""A stand-in for torch: byte tensors on a device that is a ledger file."""
import json
import os

__version__ = "0.0+fake"
uint8 = "uint8"
_held = {}


class version:
    cuda = "12.4"


def _write():
    folder = os.environ.get("FAKE_TORCH_LEDGER")
    if folder:
        path = os.path.join(folder, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as out:
            json.dump({"held": sum(_held.values()), "tensors": len(_held)}, out)
        os.replace(path + ".tmp", path)


class Tensor:
    def __init__(self, size):
        self.size = size
        _held[id(self)] = size
        _write()

    def __del__(self):
        _held.pop(id(self), None)
        _write()


def empty(size, dtype=None, device=None):
    if device != "cuda" or dtype != uint8:
        raise ValueError(f"only uint8 tensors on cuda, not {dtype} on {device}")
    return Tensor(size)


class cuda:
    @staticmethod
    def is_available():
        return os.environ.get("FAKE_TORCH_DEVICES", "1") != "0"

    @staticmethod
    def init():
        return None
'''
    + _CUDA_NO_OPS
)

# A stand-in torch with as many CUDA devices as CUDA_VISIBLE_DEVICES names (or
# FAKE_TORCH_DEVICES says): each process writes what it holds, by device index, to
# `<FAKE_TORCH_LEDGER>/<pid>.json`.
SEVERAL_DEVICES = (
    '''"""A stand-in for torch with several CUDA devices, each a ledger of byte tensors."""
import json
import os

__version__ = "0.0+ranks"
uint8 = "uint8"
_held = {}
_current = [0]


def _count():
    given = os.environ.get("FAKE_TORCH_DEVICES")
    if given is not None:
        return int(given)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
    return len([part for part in visible.split(",") if part.strip()])


def _write():
    by_device = {}
    for index, size in _held.values():
        by_device[str(index)] = by_device.get(str(index), 0) + size
    path = os.path.join(os.environ["FAKE_TORCH_LEDGER"], f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as out:
        json.dump(by_device, out)
    os.replace(path + ".tmp", path)


class Tensor:
    def __init__(self, size, index):
        _held[id(self)] = (index, size)
        _write()

    def __del__(self):
        _held.pop(id(self), None)
        _write()


def empty(size, dtype=None, device=None):
    if dtype != uint8 or not str(device).startswith("cuda"):
        raise ValueError(f"only uint8 tensors on cuda, not {dtype} on {device}")
    index = _current[0] if device == "cuda" else int(device.split(":")[1])
    if index >= _count():
        raise RuntimeError("CUDA error: invalid device ordinal")
    return Tensor(size, index)


class _On:
    def __init__(self, index):
        self.index = index

    def __enter__(self):
        self.before = _current[0]
        _current[0] = self.index

    def __exit__(self, *exc):
        _current[0] = self.before


class cuda:
    device = _On

    @staticmethod
    def is_available():
        return _count() > 0

    @staticmethod
    def device_count():
        return _count()
'''
    + _CUDA_NO_OPS
)


def write_torch(folder: Path, source: str = SOURCE) -> Path:
    """The stand-in (`source`: SOURCE or SEVERAL_DEVICES) as the package `torch` in `folder`,
    which is returned: put it on a PYTHONPATH, or add it to an engine's venv, for `import
    torch` to find it."""
    (folder / "torch").mkdir(parents=True)
    (folder / "torch" / "__init__.py").write_text(source)
    return folder
