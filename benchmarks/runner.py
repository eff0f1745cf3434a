"""``python -m benchmarks [--quick] [--out DIR] [--sections ...]``: run the sections, write the results.

Order: one local Ray cluster of this run's own; the stand-in app (the real
Ingress and registry) for staging (on the head node's store, then on a second,
pre-faulted node: ``benchmarks.staging``), fetch, registry and memory; the real
apps for end to end; the cluster is shut down (the plots are drawn meanwhile);
last, results.json and results.md are written. A section that fails is recorded
under ``errors`` and the others still run; the exit status is then 1. Targets
that are not met do not change the exit status: they are findings, not failures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import importlib
import json
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable

import ray

from benchmarks.cluster import load_average, local_cluster, machine, run_token, start_serve
from benchmarks.cpu import CpuLedger
from benchmarks.plan import RUN_ORDER, SECTIONS, SIZES, Context, Plan, Progress
from benchmarks.stats import Results

if TYPE_CHECKING:
    from benchmarks import standin
    from benchmarks.probes import Probes

DEFAULT_OUT = os.path.join("benchmarks", "results")
# Imported in a thread while Ray starts the cluster (torch and Serve take seconds of CPU to
# import; on 2 cores the cluster's start-up leaves one mostly idle).
_SECTION_MODULES = (
    "end_to_end", "fetch", "lifecycle", "memory", "probes", "report", "scale_out", "schema", "staging", "standin",
)


def _in_thread(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """Run ``fn(*args)`` in a thread of its own; its future."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=fn.__name__)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def _import_sections() -> None:
    """Import the sections' modules, and matplotlib for the report (run in a thread)."""
    for name in _SECTION_MODULES:
        importlib.import_module(f"benchmarks.{name}")
    importlib.import_module("benchmarks.report").preload()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the CI smoke run: every figure, few samples (1-2 minutes)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument("--no-progress", action="store_true", help="plain progress lines instead of a bar")
    args = parser.parse_args(argv)
    requested = [s for s in args.sections.split(",") if s]
    unknown = set(requested) - set(SECTIONS)
    if unknown or not requested:
        parser.error(f"unknown or no sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    args.sections = tuple(s for s in SECTIONS if s in requested)
    return args


class _Phases:
    """Wall and CPU seconds (of every process of the run) per phase: where a run's time goes."""

    def __init__(self) -> None:
        self.table: dict[str, dict[str, float]] = {}
        self._ledger = CpuLedger()
        self._wall, self._cpu = time.perf_counter(), self._ledger.total()

    def mark(self, phase: str) -> None:
        wall, cpu = time.perf_counter(), self._ledger.total()
        self.table[phase] = {"wall_s": wall - self._wall, "cpu_s": cpu - self._cpu}
        self._wall, self._cpu = wall, cpu


def _guarded(errors: dict[str, str], phases: _Phases, section: str, body: Callable[[], None]) -> None:
    try:
        body()
    except Exception:  # noqa: BLE001 - recorded; the other sections still run
        errors[section] = traceback.format_exc()
        print(f"\nsection {section} failed:\n{errors[section]}", file=sys.stderr)
    finally:
        phases.mark(section)


def _start_probes(plan: Plan, sections: tuple[str, ...]) -> Probes | None:
    """The measuring actors, if a section needs them (created now, ready in ``_deploy``)."""
    from benchmarks.probes import Probes

    if not {"fetch", "registry", "memory"} & set(sections):
        return None
    return Probes.start(plan.fetch_ranks, list(SIZES))


def _deploy(ctx: Context, sections: tuple[str, ...]) -> standin.StandInApp | None:
    """Every app the sections need, started at once before anything is timed (the apps
    are then left idle until the end: deleting one costs more than it idles)."""
    from ray import serve
    from ray.serve import RunTarget

    from benchmarks import end_to_end, staging, standin

    uses_standin = bool({"fetch", "staging", "registry", "scale", "memory"} & set(sections))
    targets = []
    registry_name = ctx.name("bench_registry")
    if uses_standin:
        app = standin.application(list(staging.STAGING_SIZES), registry_name, ctx.cluster["namespace"])
        targets.append(RunTarget(app, name=standin.APP, route_prefix=f"/{standin.APP}"))
    if "e2e" in sections:
        for model in end_to_end.MODELS:
            app = end_to_end.app_name(model)
            targets.append(RunTarget(end_to_end.application(ctx, model), name=app, route_prefix=f"/{app}"))
    serve.run_many(targets)
    if ctx.probes is not None:
        ctx.probes.ready()
    return standin.connect(registry_name, ctx.cluster["namespace"]) if uses_standin else None


def _retire_standin(ctx: Context, app: standin.StandInApp) -> None:
    """Remove the stand-in app, its registry and the probe actors once no section needs them."""
    from ray import serve

    from benchmarks import standin

    ray.kill(app.registry)
    if ctx.probes is not None:
        for actor in (*ctx.probes.ranks, ctx.probes.noop):
            ray.kill(actor)
    serve.delete(standin.APP, _blocking=ctx.plan.blocking_cleanup)


def run(plan: Plan, sections: tuple[str, ...], progress_bar: bool = True, out_dir: str | None = None) -> dict[str, Any]:
    """Run ``sections``; return the results document. With ``out_dir``, the plots are drawn
    there while the cluster shuts down (they need the figures only)."""
    results, errors, phases = Results(), {}, _Phases()
    plotting: concurrent.futures.Future | None = None
    token = run_token()
    started = datetime.datetime.now(datetime.timezone.utc)
    wall = time.perf_counter()
    load_at_start = load_average()  # before this run adds any
    loading = _in_thread(_import_sections)
    progress: Progress | None = None
    print("starting a local Ray cluster", file=sys.stderr, flush=True)
    try:
        with local_cluster(f"epd-bench-{token}") as cluster:
            # The probes first: their processes start while Serve's controller and proxy do.
            probes = _start_probes(plan, sections)
            cluster.update(start_serve())
            loading.result()
            from benchmarks import report

            progress = Progress(3 + _steps(plan, sections), enabled=progress_bar)
            info = {**machine(), "load_avg_at_start": load_at_start}
            phases.mark("cluster_up")
            progress.step("cluster up")
            ctx = Context(plan=plan, results=results, progress=progress, cluster=cluster, token=token, probes=probes)
            app = _deploy(ctx, sections)
            phases.mark("deploy")
            progress.step("apps deployed")
            _run_sections(ctx, app, sections, errors, phases)
            if out_dir is not None:
                plotting = _in_thread(report.write_plots, {"figures": results.figures}, out_dir)
        phases.mark("cluster_down")
        progress.step("cluster down")
    finally:
        if progress is not None:
            progress.close()
    info["load_avg_at_end"] = load_average()
    doc = _document(plan, sections, results, phases, info, cluster, started, time.perf_counter() - wall)
    if errors:
        doc["errors"] = errors
    if plotting is not None:
        plotting.result()
    return doc


def _steps(plan: Plan, sections: tuple[str, ...]) -> int:
    """The progress bar's steps of ``sections``."""
    from benchmarks import end_to_end, fetch, lifecycle, memory, scale_out, staging

    steps = {
        "fetch": fetch.steps(plan),
        "staging": staging.steps(plan),
        "registry": lifecycle.steps(plan),
        "scale": scale_out.steps(plan),
        "memory": memory.steps(plan),
        "e2e": end_to_end.steps(plan),
    }
    return sum(steps[s] for s in sections)


def _run_sections(ctx: Context, app: Any, sections: tuple[str, ...], errors: dict[str, Any], phases: _Phases) -> None:
    from benchmarks import end_to_end, fetch, lifecycle, memory, scale_out, staging

    plan = ctx.plan
    # Staging first: its cold burst needs object-store pages no section has touched.
    # Its pre-faulted run comes next; in quick mode it comes last but e2e, and its node
    # and app are set up meanwhile (mostly waiting; those sections leave CPU spare).
    prefaulted: staging.Prefaulted | None = None

    def run_prefaulted() -> None:
        nonlocal prefaulted
        prefaulted = prefaulted or staging.Prefaulted(ctx)
        prefaulted.run()

    bodies: dict[str, Callable[[], None]] = {
        "staging": lambda: staging.run(ctx, app),
        "fetch": lambda: fetch.run(ctx, app),
        "registry": lambda: lifecycle.run(ctx, app),
        "scale": lambda: scale_out.run(ctx, SIZES, app.registry_name),
        "memory": lambda: memory.run(ctx, app),
        "e2e": lambda: end_to_end.run(ctx),
        "staging_prealloc": run_prefaulted,
    }
    order = [s for s in RUN_ORDER if s in sections]
    if "staging" in sections:
        anchor = [s for s in order if s != "e2e"][-1] if plan.prefaulted_setup_overlaps else "staging"
        order.insert(order.index(anchor) + 1, "staging_prealloc")
    try:
        for section in order:
            if section == "e2e" and app is not None:
                _retire_standin(ctx, app)  # idle actors still cost CPU that the served models would miss
            _guarded(errors, phases, section, bodies[section])
            if section == "staging" and plan.prefaulted_setup_overlaps:
                prefaulted = staging.Prefaulted(ctx)
    finally:
        if prefaulted is not None:
            prefaulted.close()  # never leave the node running (an error above)


def _document(
    plan: Plan, sections: tuple[str, ...], results: Results, phases: _Phases, info: dict[str, Any],
    cluster: dict[str, Any], started: datetime.datetime, wall_s: float,
) -> dict[str, Any]:
    """The results document (``benchmarks.schema``)."""
    from benchmarks import schema

    return {
        "schema_version": schema.SCHEMA_VERSION,
        "tool": "python -m benchmarks",
        "mode": plan.mode,
        "sections": list(sections),
        "started_at": started.isoformat(timespec="seconds"),
        "wall_s": wall_s,
        "phases": phases.table,
        "machine": info,
        "cluster": cluster,
        "plan": dataclasses.asdict(plan),
        "figures": results.figures,
        "ratios": results.ratios,
        "targets": results.targets,
        "summary": {"targets_met": sum(t["met"] for t in results.targets), "targets_total": len(results.targets)},
        "notes": results.notes,
        "files": {"markdown": "results.md", "plots": list(schema.PLOTS)},
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    plan = Plan.quick() if args.quick else Plan.default()
    os.makedirs(args.out, exist_ok=True)
    doc = run(plan, args.sections, progress_bar=not args.no_progress, out_dir=args.out)
    from benchmarks import report, schema  # loaded by run()

    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    report.write_markdown(doc, args.out)
    problems = schema.validate(doc)
    met, total = doc["summary"]["targets_met"], doc["summary"]["targets_total"]
    print(
        f"{met}/{total} targets met in {doc['wall_s']:.0f} s; results in {os.path.abspath(args.out)}", file=sys.stderr
    )
    for problem in problems:
        print(f"schema: {problem}", file=sys.stderr)
    return 1 if problems or "errors" in doc else 0
