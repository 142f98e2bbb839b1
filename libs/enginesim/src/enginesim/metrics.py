"""Prometheus text exposition, as prometheus_client writes it (enough for the engines' names)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Labels = Mapping[str, str]

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += 1


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return "{" + inner + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Exposition:
    def __init__(self) -> None:
        self._lines: list[str] = []

    def _head(self, name: str, kind: str, text: str) -> None:
        self._lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]

    def gauge(self, name: str, text: str, samples: Iterable[tuple[Labels, float]]) -> None:
        self._head(name, "gauge", text)
        self._lines += [f"{name}{_labels(lbl)} {_number(v)}" for lbl, v in samples]

    def counter(
        self, name: str, text: str, samples: Iterable[tuple[Labels, float]], suffix: str = "_total"
    ) -> None:
        """As prometheus_client: `# TYPE <name> counter`, samples as `<name>_total`.

        llama.cpp writes the full name everywhere: pass it whole, with `suffix=""`.
        """
        self._head(name, "counter", text)
        self._lines += [f"{name}{suffix}{_labels(lbl)} {_number(v)}" for lbl, v in samples]

    def histogram(self, name: str, text: str, labels: Labels, hist: Histogram) -> None:
        self._head(name, "histogram", text)
        for bound, count in zip(hist.buckets, hist.counts, strict=True):
            le = {**labels, "le": _number(bound)}
            self._lines.append(f"{name}_bucket{_labels(le)} {_number(count)}")
        inf = {**labels, "le": "+Inf"}
        self._lines += [
            f"{name}_bucket{_labels(inf)} {_number(hist.count)}",
            f"{name}_count{_labels(labels)} {_number(hist.count)}",
            f"{name}_sum{_labels(labels)} {_number(hist.total)}",
        ]

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"
