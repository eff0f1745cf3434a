"""results.md (Markdown tables, targets and ratios first) and the two PNG plots.

Both are drawn from the results document alone, so they can be regenerated from
a saved results.json: ``python -c "import json, benchmarks.report as r;
r.write_all(json.load(open('results.json')), 'DIR')"``.
"""

from __future__ import annotations

import os
from typing import Any

# The report's order, whatever order the sections ran in.
ORDER = ("fetch", "staging", "registry", "scale", "e2e", "memory")
CAVEAT = (
    "Measured on a shared machine: absolute times move with whatever else runs (the load average is given "
    "above). Only ratios of figures measured side by side in this run are judged; compare runs by their "
    "ratios, not their times."
)


def _fmt(value: float, unit: str = "") -> str:
    if unit == "s":
        return f"{value * 1e3:.3f} ms"
    if unit == "s/MB":
        return f"{value * 1e3:.3f} ms/MB"
    if unit == "B":
        return f"{value / 1e6:.2f} MB"
    if abs(value) >= 1000 or value == int(value):
        return f"{value:,.0f}" + (f" {unit}" if unit else "")
    return f"{value:.3g}" + (f" {unit}" if unit else "")


def _labels(labels: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in labels.items()) or "-"


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    load = m.get("load_avg_at_start") or []
    lines = [
        "# epd-encoder benchmarks",
        "",
        f"`python -m benchmarks{' --quick' if doc['mode'] == 'quick' else ''}`, {doc['started_at']}, "
        f"{doc['wall_s']:.0f} s. Machine: {m['cpu_count']} CPUs ({m.get('cpu_model')}), "
        f"{(m.get('ram_bytes') or 0) / 2**30:.0f} GiB RAM, GPU: {m.get('gpu_name') or 'none'}; Python {m['python']}, "
        f"torch {m['torch']}, Ray {m['ray']}. Load average at start/end: "
        f"{', '.join(f'{x:.2f}' for x in load)} / {', '.join(f'{x:.2f}' for x in m.get('load_avg_at_end') or [])}.",
        "",
        f"> {CAVEAT}",
        "",
        f"## Targets ({doc['summary']['targets_met']} of {doc['summary']['targets_total']} met)",
        "",
        "| section | target | labels | measured | required | met |",
        "|---|---|---|---|---|---|",
    ]
    for t in sorted(doc["targets"], key=lambda t: ORDER.index(t["section"])):
        lines.append(
            f"| {t['section']} | {t['description']} | {_labels(t['labels'])} | {t['value']:.3g} | "
            f"{t['op']} {t['target']:g} | {'yes' if t['met'] else '**no**'} |"
        )
    lines += ["", "## Ratios", "", "| ratio | labels | value | how |", "|---|---|---|---|"]
    for r in sorted(doc["ratios"].values(), key=lambda r: ORDER.index(r["section"])):
        lines.append(f"| {r['section']}.{r['name']} | {_labels(r['labels'])} | {r['value']:.3g} | {r['how']} |")
    sections = [s for s in ORDER if any(f["section"] == s for f in doc["figures"].values())]
    for section in sections:
        lines += [
            "",
            f"## Figures: {section}",
            "",
            "| figure | labels | p50 / value | p99 | n |",
            "|---|---|---|---|---|",
        ]
        for f in doc["figures"].values():
            if f["section"] != section:
                continue
            stats = f.get("stats")
            p99 = _fmt(stats["p99"], f["unit"]) if stats else ""
            lines.append(
                f"| {f['name']} | {_labels(f['labels'])} | {_fmt(f['value'], f['unit'])} | {p99} | {f.get('n', '')} |"
            )
        for note in doc.get("notes", {}).get(section, []):
            lines += ["", f"- {note}"]
    for section, trace in doc.get("errors", {}).items():
        lines += ["", f"## Error in {section}", "", "```", trace.strip()[-3000:], "```"]
    return "\n".join(lines) + "\n"


def _series(doc: dict[str, Any], section: str, name: str, **fixed: Any) -> tuple[list[float], list[dict]]:
    rows = [
        f
        for f in doc["figures"].values()
        if f["section"] == section
        and f["name"] == name
        and all(str(f["labels"].get(k)) == str(v) for k, v in fixed.items())
    ]
    return [r["value"] for r in rows], rows


def plot_latency(doc: dict[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt

    fig, (ax_fetch, ax_stage) = plt.subplots(1, 2, figsize=(12, 4.5))
    _plot_fetch(doc, ax_fetch)
    _plot_staging(doc, ax_stage)
    for ax in (ax_fetch, ax_stage):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_fetch(doc: dict[str, Any], ax: Any) -> None:
    for name, label, style in (
        ("registry_fetch_s", "EmbeddingReceiver.fetch", "o-"),
        ("zmq_s", "ZMQ PUSH/PULL", "s-"),
        ("memcpy_warm_s", "memcpy", "^--"),
        ("actor_rtt_s", "async actor round trip", "x:"),
    ):
        values, rows = _series(doc, "fetch", name)
        if rows:
            sizes = [float(r["labels"]["size_mb"]) for r in rows]
            ax.errorbar(
                sizes,
                [v * 1e3 for v in values],
                fmt=style,
                label=f"{label} (p50)",
                capsize=3,
                yerr=[[0] * len(rows), [(r["stats"]["p99"] - r["value"]) * 1e3 for r in rows]],
            )
    ax.set(
        title="Fetch to a usable bf16 tensor (bars: p99)",
        xlabel="embedding size (MB)",
        ylabel="ms",
        xscale="log",
        yscale="log",
    )


def _plot_staging(doc: dict[str, Any], ax: Any) -> None:
    for pre, marker in (("off", "o"), ("on", "s")):
        for name, label in (("staging_extra_s", "staging (submit - inline submit)"), ("put_s", "ray.put")):
            values, rows = _series(doc, "staging", name, prealloc=pre)
            # A log axis: a difference that noise made zero or negative is left out of the plot.
            points = [(float(r["labels"]["size_mb"]), v * 1e3) for r, v in zip(rows, values, strict=True) if v > 0]
            if points:
                ax.plot(
                    *zip(*points, strict=True),
                    marker=marker,
                    linestyle="-" if name == "put_s" else "--",
                    label=f"{label}, prealloc {pre}",
                )
    ax.set(
        title="Staging after the forward pass (p50)",
        xlabel="embedding size (MB)",
        ylabel="ms",
        xscale="log",
        yscale="log",
    )


def plot_throughput(doc: dict[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(f["labels"]["model"] for f in doc["figures"].values() if f["section"] == "e2e"))
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(5 * (len(models) + 1), 4.5), squeeze=False)
    axes = list(axes[0])
    for ax, model in zip(axes[:-1], models, strict=True):
        for p in ("handle", "http"):
            values, rows = _series(doc, "e2e", "images_per_s", model=model, path=p)
            ax.plot([r["labels"]["concurrency"] for r in rows], values, "o-", label=f"served, {p}")
        for name, label, style in (
            ("inprocess_forward_images_per_s", "in-process forward", "--"),
            ("inprocess_pipeline_images_per_s", "in-process preprocess + forward", ":"),
        ):
            values, _ = _series(doc, "e2e", name, model=model, when="best")
            if values:
                ax.axhline(values[0], linestyle=style, color="gray", label=label)
        ax.set(title=f"End to end: {model}", xlabel="concurrent requests", ylabel="images/s")
    ax = axes[-1]
    values, rows = _series(doc, "registry", "lifecycles_per_s")
    calls, _ = _series(doc, "registry", "registry_calls_per_lifecycle")
    if rows:
        conc = [r["labels"]["concurrency"] for r in rows]
        ax.plot(conc, values, "o-", label="lifecycles/s (submit + 4 fetches)")
        raw, _ = _series(doc, "registry", "raw_calls_per_s")
        per = calls[0] if calls else 5
        ax.plot(conc, [r / per for r in raw], "s--", label=f"raw no-op calls/s / {per:g}")
        ax.plot(conc, [0.8 * r / per for r in raw], ":", color="gray", label="target (80%)")
    ax.set(title="Registry lifecycles", xlabel="calls in flight per client", ylabel="per second")
    for ax in axes:
        # The data lines' x values (axhline's are axes fractions, and have no marker).
        levels = sorted(
            {x for line in ax.get_lines() if line.get_marker() not in (None, "None", "") for x in line.get_xdata()}
        )
        if levels:
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [f"{x:g}" for x in levels])
            ax.minorticks_off()
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def preload() -> None:
    """Import matplotlib for the plots (half a second of CPU: the runner does it early)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def write_plots(doc: dict[str, Any], out_dir: str) -> list[str]:
    """Draw the plots into ``out_dir``; they need ``doc["figures"]`` only."""
    preload()
    plot_latency(doc, os.path.join(out_dir, "latency_vs_size.png"))
    plot_throughput(doc, os.path.join(out_dir, "throughput_vs_concurrency.png"))
    return ["latency_vs_size.png", "throughput_vs_concurrency.png"]


def write_markdown(doc: dict[str, Any], out_dir: str) -> list[str]:
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(doc))
    return ["results.md"]


def write_all(doc: dict[str, Any], out_dir: str) -> list[str]:
    """Write results.md and the plots into ``out_dir``; return the file names written."""
    return write_markdown(doc, out_dir) + write_plots(doc, out_dir)
