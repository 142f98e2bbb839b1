"""Models across several GPUs in end-to-end tests: the simulated host's GPUs and topology, a
model folder whose config gives its heads, and which processes of an engine hold which GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai

from capycommon.domain.memory import MemoryReading
from cluster import Cluster
from support import wait_for

GiB = 1 << 30
GPUS = "gpu0:24GiB,gpu1:24GiB,gpu2:24GiB,gpu3:24GiB;gpu0-gpu1:nvlink,gpu2-gpu3:nvlink"
# Per GPU, as the engines read their own figures.
BIG: dict[str, Any] = {"tensor_parallel": 2, "memory": {"request": "16GiB", "startup": "18GiB"}}
HI: list[Any] = [{"role": "user", "content": "hi"}]


def heads_model(folder: Path, size: int, heads: int = 32, kv: int = 8) -> None:
    """A sparse model folder whose config.json gives its attention and key-value heads."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
    }
    (folder / "config.json").write_text(json.dumps(config))
    with (folder / "model.safetensors").open("wb") as handle:
        handle.truncate(size)


def ask(client: openai.OpenAI, model: str) -> None:
    answer = client.chat.completions.create(model=model, messages=HI, max_tokens=4)
    assert answer.choices[0].message.content, f"{model} answered nothing"


def holders(cluster: Cluster, name: str) -> dict[str, list[int]]:
    """GPU name -> the PIDs of `name`'s engine holding memory there, from memwatch."""
    record = cluster.instance(name)
    assert record is not None
    assert record.process is not None
    group = record.process.pgid
    reading: MemoryReading | None = cluster.blocking(lambda s: s.memory.reading("local"))
    assert reading is not None
    found: dict[str, list[int]] = {}
    for gpu in reading.gpus:
        for pid, held in gpu.processes.items():
            if held and _pgid(pid) == group:
                found.setdefault(gpu.name, []).append(pid)
    return found


def _pgid(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[2])


def ranks(cluster: Cluster, name: str, count: int = 2) -> dict[str, list[int]]:
    """`holders`, once a process of the engine holds memory on each of `count` GPUs."""

    def found() -> dict[str, list[int]] | None:
        held = holders(cluster, name)
        return held if len(held) == count else None

    return wait_for(found, timeout=15, what=f"a process of {name}'s engine on each of its GPUs")
