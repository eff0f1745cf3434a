"""The schema of ``results.json`` (version 1), and its validator.

Top level::

    schema_version  1
    tool, mode      "python -m benchmarks", "default" | "quick"
    sections        the sections run, in order
    started_at      ISO 8601, UTC;  wall_s: seconds for the whole run
    phases          {phase: {"wall_s", "cpu_s"}}: wall time, and CPU time of every process
                    of the run, per phase (cluster_up, deploy, each section, cluster_down)
    machine         cpu_count, cpu_model, ram_bytes, gpu, gpu_name, python, platform,
                    torch, ray, numpy, executable, load_avg_at_start, load_avg_at_end
    cluster         the benchmark's own Ray cluster: namespace, num_cpus_logical,
                    object_store_bytes, preallocate_plasma_memory (of the main cluster)
    plan            the sample counts of the mode (``benchmarks.plan.Plan``)
    figures         {id: figure}; id = "section.name{label=value,...}"
    ratios          {id: ratio}
    targets         [target]
    summary         {"targets_met": int, "targets_total": int}
    notes           {section: [method notes and observations]}
    errors          {section: traceback} for sections that failed (absent when none did)
    files           {"markdown": "results.md", "plots": [file names]}

A figure is ``{section, name, labels, value, unit}``, plus ``n`` (samples) and,
for distributions, ``stats`` = ``{p50, p99, mean, min, max, n}`` with ``value`` =
p50. Units: ``s``, ``s/MB``, ``B``, ``1/s``, ``images/s``, ``calls``,
``parameters``, ``threads``. A ratio is ``{section, name, labels, value, unit:
"ratio", inputs: [figure ids], how}``. A target is ``{id, section, name, labels,
value, op, target, met: bool, description, inputs}``, met meaning
``value <op> target``.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks import end_to_end, lifecycle, memory, scale_out, service_cpu, staging, standin
from benchmarks.plan import SECTIONS, SIZES, Plan
from benchmarks.stats import figure_id, size_label

SCHEMA_VERSION = 1
UNITS = {"s", "s/MB", "B", "1/s", "images/s", "calls", "parameters", "threads"}
MACHINE_KEYS = {"cpu_count", "ram_bytes", "gpu", "python", "torch", "ray"}
# Differences and leftovers: finite, but noise can make them zero or negative.
ANY_SIGN = {
    "staging_extra_s",
    "cold_staging_extra_s",
    "bytes_left_after_release",
    "baseline_store_bytes",
    "staging_s_per_mb",
    "memcpy_warm_s_per_mb",
    "memcpy_fresh_s_per_mb",
    "put_s_per_mb",
    "cpu_s_per_raw_call",
    "cpu_s_per_lifecycle",
    "cpu_s_per_image",
    "fetch_errors",
}
PLOTS = ("latency_vs_size.png", "throughput_vs_concurrency.png")


def expected(plan: Plan, sections: tuple[str, ...] = SECTIONS) -> dict[str, list[str]]:
    """The figure, ratio and target ids a complete run of ``sections`` produces."""
    figures: list[str] = []
    ratios: list[str] = []
    targets: list[str] = []
    for section, expect in (
        ("fetch", _expect_fetch),
        ("staging", _expect_staging),
        ("registry", _expect_registry),
        ("scale", _expect_scale),
        ("memory", _expect_memory),
        ("e2e", _expect_e2e),
    ):
        if section in sections:
            expect(plan, figures, ratios, targets)
    return {"figures": figures, "ratios": ratios, "targets": targets}


def _expect_fetch(plan: Plan, figures: list[str], ratios: list[str], targets: list[str]) -> None:
    for n in SIZES:
        lab = {"size_mb": size_label(n)}
        figures += [
            figure_id(f"fetch.{name}", lab)
            for name in (
                "registry_fetch_s",
                "zmq_s",
                "actor_rtt_s",
                "memcpy_warm_s",
                "memcpy_fresh_s",
                "size_bytes",
            )
        ]
        ratios += [figure_id(f"fetch.{name}", lab) for name in ("fetch_vs_rtt_plus_memcpy", "fetch_vs_zmq")]
        targets += [figure_id("fetch.fetch_vs_rtt_plus_memcpy", lab), figure_id("fetch.bf16_zero_copy", lab)]
        if n >= 4_700_000:
            targets.append(figure_id("fetch.fetch_vs_zmq", lab))


def _expect_staging(plan: Plan, figures: list[str], ratios: list[str], targets: list[str]) -> None:
    for pre in ("off", "on"):
        base = {"prealloc": pre}
        figures.append(figure_id("staging.submit_s", {**base, "size_mb": size_label(standin.TINY)}))
        for n in staging.STAGING_SIZES:
            lab = {**base, "size_mb": size_label(n)}
            figures += [
                figure_id(f"staging.{name}", lab)
                for name in ("submit_s", "put_s", "memcpy_warm_s", "memcpy_fresh_s", "staging_extra_s")
            ]
            ratios.append(figure_id("staging.staging_vs_put", lab))
        figures += [
            figure_id(f"staging.{name}", base)
            for name in ("staging_s_per_mb", "put_s_per_mb", "memcpy_warm_s_per_mb", "memcpy_fresh_s_per_mb")
        ]
        ratios += [
            figure_id(f"staging.{name}", base) for name in ("staging_per_mb_vs_put", "staging_per_mb_vs_memcpy")
        ]
        cold = {**base, "size_mb": size_label(SIZES[1])}
        figures += [figure_id(f"staging.{name}", cold) for name in ("cold_put_s", "cold_staging_extra_s")]
        ratios += [figure_id(f"staging.{name}", cold) for name in ("cold_staging_vs_put", "cold_put_vs_warm_put")]
    targets += [
        figure_id("staging.staging_per_mb_vs_put", {"prealloc": "off"}),
        figure_id("staging.copies_before_store", {"prealloc": "off"}),
    ]


def _expect_registry(plan: Plan, figures: list[str], ratios: list[str], targets: list[str]) -> None:
    for c in plan.lifecycle_concurrency:
        figures += [
            figure_id(f"registry.{name}", {"concurrency": c}) for name in ("raw_calls_per_s", "lifecycles_per_s")
        ]
    figures += ["registry.registry_calls_per_lifecycle", "registry.fetch_errors"]
    top = {"concurrency": max(plan.lifecycle_concurrency)}
    figures += [figure_id("registry.cpu_s_per_raw_call", {**top, "process": p}) for p in lifecycle.RAW_ROLES]
    figures += [figure_id("registry.cpu_s_per_lifecycle", {**top, "process": p}) for p in lifecycle.LIFECYCLE_ROLES]
    figures.append(figure_id("registry.serve_calls_per_s", top))
    ratios += [figure_id(f"registry.{name}", top) for name in ("lifecycles_vs_raw_per_call", "lifecycles_vs_raw_with_serve_call")]
    targets += [figure_id("registry.lifecycles_vs_raw_per_call", top), "registry.registry_calls_per_lifecycle"]


def _expect_scale(plan: Plan, figures: list[str], ratios: list[str], targets: list[str]) -> None:
    for shards, tp in scale_out.configs():
        lab = {"shards": shards, "tp": tp}
        figures += [figure_id(f"scale.{name}", lab) for name in ("lifecycles_per_s", "fetch_errors")]
        figures += [figure_id("scale.cpu_s_per_lifecycle", {**lab, "process": p}) for p in scale_out.ROLES]
    for path in service_cpu.PATHS:
        lab = {"path": path, "tp": scale_out.RECEIVE_COUNT}
        figures += [figure_id(f"scale.{name}", lab) for name in ("lifecycles_per_s", "fetch_errors")]
        figures += [figure_id("scale.cpu_s_per_lifecycle", {**lab, "process": p}) for p in service_cpu.ROLES]
        targets += [figure_id("scale.cpu_s_per_lifecycle", {**lab, "process": p}) for p in ("service", "registry")]
    lab = {"shards": max(scale_out.SHARD_COUNTS), "batch": plan.scale_batch}
    figures += [figure_id(f"scale.{name}", lab) for name in ("fetch_many_s_per_request", "fetch_in_flight_s_per_request")]
    ratios.append(figure_id("scale.fetch_many_vs_in_flight", lab))
    for n in SIZES:
        lab = {"size_mb": size_label(n)}
        figures += [figure_id(f"scale.quiet_{name}_s", lab) for name in ("fetch", "round_trip", "memcpy")]
        ratios.append(figure_id("scale.quiet_fetch_vs_round_trip_plus_memcpy", lab))
        targets.append(figure_id("scale.quiet_fetch_vs_round_trip_plus_memcpy", lab))


def _expect_memory(plan: Plan, figures: list[str], ratios: list[str], targets: list[str]) -> None:
    figures.append("memory.input_bytes_per_request")
    for path in memory.PATHS:
        lab = {"path": path}
        figures += [
            figure_id(f"memory.{name}", lab)
            for name in (
                "staged_bytes",
                "peak_store_bytes_above_baseline",
                "baseline_store_bytes",
                "return_to_baseline_s",
                "bytes_left_after_release",
            )
        ]
        ratios += [figure_id(f"memory.{name}", lab) for name in ("peak_per_staged_byte", "extra_peak_per_input_byte")]
        targets += [figure_id(f"memory.{name}", lab) for name in ("peak_per_staged_byte", "returns_to_baseline")]


def _expect_e2e(plan: Plan, figures: list[str], ratios: list[str], targets: list[str]) -> None:
    for model in end_to_end.MODELS:
        lab = {"model": model}
        figures += [figure_id(f"e2e.{name}", lab) for name in ("model_parameters", "replica_torch_threads")]
        figures += [
            figure_id(f"e2e.inprocess_{kind}_images_per_s", {**lab, "when": when})
            for kind in ("forward", "pipeline")
            for when in ("before", "after", "best")
        ]
        for path in end_to_end.PATHS:
            for c in plan.e2e_concurrency:
                lab = {"model": model, "path": path, "concurrency": c}
                figures += [figure_id("e2e.images_per_s", lab), figure_id("e2e.latency_s", lab)]
            lab = {"model": model, "path": path}
            figures.append(figure_id("e2e.saturated_images_per_s", lab))
            figures += [figure_id("e2e.cpu_s_per_image", {**lab, "process": p}) for p in end_to_end.ROLES]
            ratios += [
                figure_id("e2e.served_vs_inprocess", lab),
                figure_id("e2e.served_vs_inprocess_pipeline", lab),
            ]
            if model == "vit_b":
                targets.append(figure_id("e2e.served_vs_inprocess", lab))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate(doc: dict[str, Any]) -> list[str]:
    """Everything wrong with ``doc`` as a complete results.json of its own mode; [] when it holds."""
    problems: list[str] = []
    for key in (
        "schema_version",
        "mode",
        "sections",
        "started_at",
        "wall_s",
        "machine",
        "cluster",
        "plan",
        "figures",
        "ratios",
        "targets",
        "summary",
        "files",
    ):
        if key not in doc:
            problems.append(f"missing top-level key {key!r}")
    if problems:
        return problems
    problems += _check_values(doc)
    try:
        plan = Plan(**{k: tuple(v) if isinstance(v, list) else v for k, v in doc["plan"].items()})
    except TypeError as exc:
        return problems + [f"plan does not match Plan: {exc}"]
    want = expected(plan, tuple(doc["sections"]))
    target_ids = {t.get("id") for t in doc["targets"]}
    problems += [f"missing figure {k}" for k in want["figures"] if k not in doc["figures"]]
    problems += [f"missing ratio {k}" for k in want["ratios"] if k not in doc["ratios"]]
    problems += [f"missing target {k}" for k in want["targets"] if k not in target_ids]
    if doc["summary"].get("targets_total") != len(doc["targets"]):
        problems.append("summary.targets_total does not count the targets")
    return problems


def _check_values(doc: dict[str, Any]) -> list[str]:
    """What is wrong with the document's version, machine, figures, ratios and targets."""
    problems: list[str] = []
    if doc["schema_version"] != SCHEMA_VERSION:
        problems.append(f"schema_version {doc['schema_version']!r} != {SCHEMA_VERSION}")
    problems += [f"machine lacks {k!r}" for k in sorted(MACHINE_KEYS - set(doc["machine"]))]
    for key, fig in doc["figures"].items():
        if not {"section", "name", "labels", "value", "unit"} <= set(fig):
            problems.append(f"figure {key} lacks fields")
            continue
        if fig["unit"] not in UNITS:
            problems.append(f"figure {key} has unknown unit {fig['unit']!r}")
        if not _finite(fig["value"]) or (fig["name"] not in ANY_SIGN and fig["value"] <= 0):
            problems.append(
                f"figure {key} = {fig['value']!r} is not a {'finite' if fig['name'] in ANY_SIGN else 'positive'} number"
            )
        stats = fig.get("stats")
        if stats is not None and (
            stats.get("p50") != fig["value"] or not all(_finite(stats.get(k)) for k in ("p50", "p99", "n"))
        ):
            problems.append(f"figure {key} has inconsistent stats")
    for key, ratio in doc["ratios"].items():
        if not _finite(ratio.get("value")):
            problems.append(f"ratio {key} = {ratio.get('value')!r} is not finite")
        missing = [i for i in ratio.get("inputs", []) if i not in doc["figures"]]
        if missing:
            problems.append(f"ratio {key} names unknown figures {missing}")
    for target in doc["targets"]:
        if (
            not isinstance(target.get("met"), bool)
            or not _finite(target.get("value"))
            or not _finite(target.get("target"))
        ):
            problems.append(f"target {target.get('id')} is malformed")
    return problems
