"""Figures and targets, results.json and results.md, and the benchmarks' command lines.

A figure is ``{section, name, labels, value, unit}``, keyed ``section.name{label=value,...}``;
a distribution is reported by its p50, with its ``p99`` and count ``n``; a ratio of two
figures taken side by side is a figure of unit ``ratio``. A target compares one figure with
what the service aims for. Absolute times on a shared machine move with its load, so only
ratios and counts are judged.
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import os
from typing import Any

import numpy as np

_OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, "==": operator.eq}
CAVEAT = ("Measured on a shared machine: absolute times move with whatever else runs (the load average is given "
          "above). Only ratios of figures measured side by side in this run are judged.")


def figure_id(section: str, name: str, labels: dict[str, Any]) -> str:
    inner = ",".join(f"{k}={labels[k]}" for k in sorted(labels))
    return f"{section}.{name}" + (f"{{{inner}}}" if inner else "")


def size_label(nbytes: int) -> str:
    """Sizes are labelled in decimal MB with two decimals (4718592 -> "4.72")."""
    return f"{nbytes / 1e6:.2f}"


class Results:
    """Collects the figures, targets and notes of a run while its sections run."""

    def __init__(self) -> None:
        self.figures: dict[str, dict[str, Any]] = {}
        self.targets: list[dict[str, Any]] = []
        self.notes: dict[str, list[str]] = {}

    def add(self, section: str, name: str, value: float | None = None, unit: str = "s",
            samples: list[float] | None = None, n: int | None = None, **labels: Any) -> float:
        """Record one figure (with ``samples``: their p50, p99 and count); its value."""
        key = figure_id(section, name, labels)
        if key in self.figures:
            raise ValueError(f"figure {key} recorded twice")
        record = {"section": section, "name": name, "labels": labels, "unit": unit}
        if samples is not None:
            value = float(np.percentile(samples, 50))
            record |= {"p99": float(np.percentile(samples, 99)), "n": len(samples)}
        elif n is not None:
            record["n"] = n
        self.figures[key] = {**record, "value": float(value)}
        return float(value)

    def ratio(self, section: str, name: str, numerator: float, denominator: float, **labels: Any) -> float:
        return self.add(section, name, numerator / denominator if denominator else math.inf, "ratio", **labels)

    def target(self, section: str, name: str, value: float, op: str, bound: float, what: str, **labels: Any) -> None:
        met = bool(_OPS[op](value, bound)) and not math.isnan(value)
        self.targets.append({"id": figure_id(section, name, labels), "section": section, "value": float(value),
                             "op": op, "bound": bound, "met": met, "what": what})

    def note(self, section: str, text: str) -> None:
        """A method note or an observation that belongs next to the section's figures."""
        self.notes.setdefault(section, []).append(text)


def _fmt(value: float, unit: str) -> str:
    scale, shown = {"s": (1e3, "ms"), "s/MB": (1e3, "ms/MB"), "B": (1e-6, "MB")}.get(unit, (1, unit))
    return f"{value * scale:.4g} {shown}"


def markdown(doc: dict[str, Any]) -> str:
    """results.md: the run and its machine, the targets, then each section's figures and notes."""
    m, met = doc["machine"], sum(t["met"] for t in doc["targets"])
    loads = " / ".join(", ".join(f"{x:.2f}" for x in m.get(k) or []) for k in ("load_avg_at_start", "load_avg_at_end"))
    lines = [f"# epd-encoder benchmarks\n\n`{doc['tool']}`, {doc['started_at']}, {doc['wall_s']:.0f} s. Machine: "
             f"{m['cpu_count']} CPUs ({m['cpu_model']}), GPU: {m['gpu_name'] or 'none'}; Python {m['python']}, torch "
             f"{m['torch']}, Ray {m['ray']}. Load average at start / end: {loads}.\n\n> {CAVEAT}\n",
             f"## Targets ({met} of {len(doc['targets'])} met)\n", "| target | id | measured | required | met |",
             "|---|---|---|---|---|"]
    lines += [f"| {t['what']} | `{t['id']}` | {t['value']:.3g} | {t['op']} {t['bound']:g} | {'yes' if t['met'] else '**no**'} |"
              for t in doc["targets"]]
    for section in doc["sections"]:
        lines += [f"\n## {section}\n", "| figure | labels | p50 / value | p99 | n |", "|---|---|---|---|---|"]
        lines += [f"| {f['name']} | {', '.join(f'{k}={v}' for k, v in f['labels'].items()) or '-'} | "
                  f"{_fmt(f['value'], f['unit'])} | {_fmt(f['p99'], f['unit']) if 'p99' in f else ''} | {f.get('n', '')} |"
                  for f in doc["figures"].values() if f["section"] == section]
        lines += [f"\n- {note}" for note in doc["notes"].get(section, [])]
        if section in doc["errors"]:
            lines += ["\n```", doc["errors"][section].strip()[-3000:], "```"]
    return "\n".join(lines) + "\n"


def write(doc: dict[str, Any], out_dir: str) -> None:
    """results.json and results.md into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(doc))


def parse_args(doc: str, argv: list[str] | None = None, **options: dict[str, Any]) -> argparse.Namespace:
    """The command line of a benchmark whose module docstring is ``doc``: each keyword is an
    option (``image_size`` -> ``--image-size``) with ``add_argument``'s keywords."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    for name, kwargs in options.items():
        parser.add_argument("--" + name.replace("_", "-"), **kwargs)
    return parser.parse_args(argv)
