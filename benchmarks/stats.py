"""Samples to figures: percentiles, the figure/ratio/target records, and the collector.

Every number the benchmark reports is a *figure*: a name, labels (such as the
embedding size), a value, a unit and, for distributions, the percentiles and the
sample count it came from. A *ratio* divides two figures measured side by side
in the same run; a *target* compares one ratio (or a count) with the value the
service aims for. Absolute times on shared machines are noisy, so only ratios are
ever judged.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import time
from typing import Any, Callable, Iterable

import numpy as np

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    "<": operator.lt,
    ">=": operator.ge,
    ">": operator.gt,
    "==": operator.eq,
}


def summarize(samples: Iterable[float]) -> dict[str, float]:
    """p50, p99, mean, min, max and n of ``samples`` (linear-interpolated percentiles)."""
    values = np.asarray(list(samples), dtype=np.float64)
    if values.size == 0:
        raise ValueError("no samples to summarize")
    return {
        "p50": float(np.percentile(values, 50)),
        "p99": float(np.percentile(values, 99)),
        "mean": float(values.mean()),
        "min": float(values.min()),
        "max": float(values.max()),
        "n": int(values.size),
    }


def figure_id(name: str, labels: dict[str, Any] | None = None) -> str:
    """``name{key=value,...}``: the stable key of a figure in results.json."""
    if not labels:
        return name
    return name + "{" + ",".join(f"{k}={labels[k]}" for k in sorted(labels)) + "}"


def size_label(nbytes: int) -> str:
    """Sizes are labelled in decimal MB with two decimals (4718592 -> "4.72")."""
    return f"{nbytes / 1e6:.2f}"


class Stopwatch:
    """``with Stopwatch() as sw: ...``; ``sw.s`` is the elapsed wall time in seconds."""

    def __enter__(self) -> "Stopwatch":
        self.start = time.perf_counter()
        self.s = 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.s = time.perf_counter() - self.start


@dataclasses.dataclass
class Results:
    """Collects figures, ratios, targets and checks while the sections run."""

    figures: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    ratios: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    targets: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def add(
        self,
        section: str,
        name: str,
        value: float,
        unit: str,
        labels: dict[str, Any] | None = None,
        samples: Iterable[float] | None = None,
        n: int | None = None,
    ) -> str:
        """Record one figure; with ``samples``, ``value`` must be their p50 (use ``add_samples``)."""
        key = figure_id(f"{section}.{name}", labels)
        if key in self.figures:
            raise ValueError(f"figure {key} recorded twice")
        record: dict[str, Any] = {
            "section": section,
            "name": name,
            "labels": dict(labels or {}),
            "value": float(value),
            "unit": unit,
        }
        if samples is not None:
            record["stats"] = summarize(samples)
            record["n"] = record["stats"]["n"]
        elif n is not None:
            record["n"] = int(n)
        self.figures[key] = record
        return key

    def add_samples(
        self, section: str, name: str, samples: list[float], unit: str, labels: dict[str, Any] | None = None
    ) -> str:
        """A distribution, reported by its p50 (``stats`` holds p99, mean, min, max and n)."""
        return self.add(section, name, summarize(samples)["p50"], unit, labels, samples=samples)

    def value(self, key: str) -> float:
        return self.figures[key]["value"]

    def ratio(
        self,
        section: str,
        name: str,
        numerator: float,
        denominator: float,
        inputs: list[str],
        labels: dict[str, Any] | None = None,
        how: str = "",
    ) -> float:
        """Record ``numerator / denominator``; ``inputs`` are the figure keys it was built from."""
        value = numerator / denominator if denominator else math.inf
        key = figure_id(f"{section}.{name}", labels)
        self.ratios[key] = {
            "section": section,
            "name": name,
            "labels": dict(labels or {}),
            "value": float(value),
            "unit": "ratio",
            "inputs": inputs,
            "how": how,
        }
        return value

    def target(
        self,
        section: str,
        name: str,
        value: float,
        op: str,
        target: float,
        description: str,
        labels: dict[str, Any] | None = None,
        inputs: list[str] | None = None,
    ) -> bool:
        """Judge ``value op target`` and record the outcome."""
        met = bool(_OPS[op](value, target)) and not math.isnan(value)
        self.targets.append(
            {
                "id": figure_id(f"{section}.{name}", labels),
                "section": section,
                "name": name,
                "labels": dict(labels or {}),
                "value": float(value),
                "op": op,
                "target": float(target),
                "met": met,
                "description": description,
                "inputs": list(inputs or []),
            }
        )
        return met

    def note(self, section: str, text: str) -> None:
        """A method note or an observation that belongs next to the section's figures."""
        self.notes.setdefault(section, []).append(text)
