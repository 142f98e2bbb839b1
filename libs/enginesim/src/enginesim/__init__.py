"""The engine simulator: a program that behaves like vLLM, SGLang or llama-server on the wire
and as a process, so that everything above the engines is tested without a GPU.

Make an install with `install_python_engine`, `install_llama_server` or `install_tensorfold`
(CapyCTL's assumed TensorFold, not a verified engine), choose its behaviour with a
`Behaviour` (rewritten between launches by `write_behaviour`), and launch it as the real
engine is launched. The behaviour to match is in the shared `reference/engines.md`.
`install_lmcache` adds a stand-in LMCache server (`LMCacheBehaviour`), in a venv of its own
or an engine's, for engines launched with LMCache's connector. `ENGINESIM_CUDA=1` in an
engine's environment makes its memory real CUDA memory through torch (`enginesim.cuda`), for
runs on a real GPU. A tensor-parallel launch runs a process per rank, each holding its share
on its own device (`enginesim.ranks`); llama.cpp splits one process over its devices.
"""

from enginesim.behaviour import (
    Behaviour,
    CrashAtStart,
    DisconnectLag,
    Faults,
    LMCacheBehaviour,
    RankDies,
    SchedulerDies,
    ToolCall,
)
from enginesim.install import (
    install_llama_server,
    install_lmcache,
    install_python_engine,
    install_tensorfold,
    write_behaviour,
)

__all__ = [
    "Behaviour",
    "CrashAtStart",
    "DisconnectLag",
    "Faults",
    "LMCacheBehaviour",
    "RankDies",
    "SchedulerDies",
    "ToolCall",
    "install_llama_server",
    "install_lmcache",
    "install_python_engine",
    "install_tensorfold",
    "write_behaviour",
]
