"""The engine simulator: a program that behaves like vLLM, SGLang or llama-server on the wire
and as a process, so that everything above the engines is tested without a GPU.

Make an install with `install_python_engine` or `install_llama_server`, choose its behaviour
with a `Behaviour` (rewritten between launches by `write_behaviour`), and launch it as the
real engine is launched. The behaviour to match is in the shared `reference/engines.md`.
"""

from enginesim.behaviour import (
    Behaviour,
    CrashAtStart,
    DisconnectLag,
    Faults,
    SchedulerDies,
    ToolCall,
)
from enginesim.install import (
    install_llama_server,
    install_python_engine,
    write_behaviour,
)

__all__ = [
    "Behaviour",
    "CrashAtStart",
    "DisconnectLag",
    "Faults",
    "SchedulerDies",
    "ToolCall",
    "install_llama_server",
    "install_python_engine",
    "write_behaviour",
]
