"""GPU sets: the GPUs of one host a deployment spans. A set is named by its GPUs joined with
`+` in rank order (`gpu2`, `gpu0+gpu1`), so a binding's footprints, a plan's actions and the
effects in flight name a set as they name one GPU.

Placement prefers the tightest set: the one whose worst link between two of its GPUs is the
best (NVLink, then one PCIe switch, one host bridge, one NUMA node, across sockets), as NVML
reports it; with no topology known every set is as tight as any other.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from functools import cache
from itertools import combinations

from capycommon.domain.memory import LINK_ORDER, Link

# A set's tightness where a link is unknown: after every known one.
UNKNOWN = len(LINK_ORDER)


def key(gpus: Iterable[str]) -> str:
    return "+".join(gpus)


@cache
def members(name: str) -> tuple[str, ...]:
    """The GPUs of a set, in rank order (`gpu0+gpu1` -> gpu0, gpu1)."""
    return tuple(name.split("+")) if name else ()


@cache
def index(gpu: str) -> int:
    """A GPU's index (`gpu3` -> 3), for ordering gpu10 after gpu9."""
    found = gpu.removeprefix("gpu")
    return int(found) if found.isdigit() else 1 << 30


def candidates(gpus: Collection[str], count: int, pinned: tuple[str, ...]) -> list[str]:
    """The sets a deployment of `count` GPUs may take among `gpus`: the pinned one, else
    every combination, lowest indices first."""
    if pinned:
        return [key(pinned)] if all(gpu in gpus for gpu in pinned) else []
    ordered = sorted(gpus, key=index)
    return [key(chosen) for chosen in combinations(ordered, count)]


def tightness(name: str, links: Mapping[frozenset[str], Link]) -> tuple[int, int]:
    """(its worst link, the sum of its links), each by LINK_ORDER: lower is tighter. One GPU
    is as tight as can be; a pair with no known link counts after every known one."""
    ranks = [
        LINK_ORDER.index(link) if (link := links.get(frozenset(pair))) else UNKNOWN
        for pair in combinations(members(name), 2)
    ]
    return (max(ranks, default=0), sum(ranks))


def describe_link(name: str, links: Mapping[frozenset[str], Link]) -> str:
    """How the GPUs of a set of several connect, for status: `all nvlink`, `worst link node`,
    or `topology unknown`."""
    worst, _ = tightness(name, links)
    if worst == UNKNOWN:
        return "topology unknown"
    every = {links.get(frozenset(pair)) for pair in combinations(members(name), 2)}
    label = LINK_ORDER[worst]
    return f"all {label}" if len(every) == 1 else f"worst link {label}"
