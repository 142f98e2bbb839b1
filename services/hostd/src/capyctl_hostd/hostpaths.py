"""Where hostd reads and writes on its host: the engine registry, its own records, the
engines' runtime folders and logs, and the model store."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class HostPaths:
    engines_file: Path
    engines_record: Path  # hostd's own record of the engines it launched
    runtime_dir: Path
    logs_dir: Path
    home: Path
    simgpu_dir: Path | None
    models_root: Path  # where downloads from the Hub land, under sources/
    state_dir: Path  # for the Hub token file
