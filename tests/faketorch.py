"""A stand-in for torch, written where a test's processes import it: the engine simulator's
CUDA mode and scripts/gpu-check call torch, and neither a GPU nor torch is here. It has a
CUDA device and no memory of its own: on simulated GPUs the claims are the memory."""

from __future__ import annotations

from pathlib import Path

# Byte tensors on a device that is a ledger file: with FAKE_TORCH_LEDGER set, each byte
# tensor's size is written, per process, to `<FAKE_TORCH_LEDGER>/<pid>.json` while it lives;
# FAKE_TORCH_DEVICES=0 sees no device.
SOURCE = '''"""A stand-in for torch: byte tensors on a device that is a ledger file."""
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

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def synchronize():
        return None
'''


def write_torch(folder: Path) -> Path:
    """The stand-in as the package `torch` in `folder`, which is returned: put it on a
    PYTHONPATH, or add it to an engine's venv, for `import torch` to find it."""
    (folder / "torch").mkdir(parents=True)
    (folder / "torch" / "__init__.py").write_text(SOURCE)
    return folder
