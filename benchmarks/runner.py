"""``python -m benchmarks [--quick] [--out DIR] [--sections a,b]``: the plan of each mode, and the run.

One local Ray cluster of the run's own; the probe actors (``benchmarks.decoder_side``), then Serve
and every app the sections need, deployed before anything is timed; the sections in
``SECTIONS``' order, the stand-in apps and probes removed before ``e2e`` (idle actors still
cost CPU the served models would miss); ``results.json`` and ``results.md`` written. A section
that fails is recorded under ``errors`` and the others still run (exit status 1); a target
not met is a finding, not a failure. ``--quick`` (the CI smoke run) produces every figure from
few samples, so its percentiles are rough.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import os
import sys
import time
import traceback
from typing import Any, Callable

import ray

from benchmarks.cluster import load_average, local_cluster, machine, run_token, start_serve
from benchmarks.report import Results, parse_args, write

# Embedding sizes of the fetch and staging sections (0.52, 4.72 and 18.87 MB):
# 64, 576 and 2304 tokens of a 4096-wide bfloat16 embedding.
SIZES = (64 * 8192, 576 * 8192, 2304 * 8192)
RECEIVE_COUNT = 4  # TP ranks per request in the lifecycle sections, and rank processes started


@dataclasses.dataclass(frozen=True)
class Plan:
    mode: str = "default"
    fetch_rounds: int = 20  # interleaved rounds per size, after two that warm every path up
    staging_rounds: int = 30  # submits per size (and as many ray.puts and memcpys)
    raw_calls: int = 2000  # no-op calls per concurrency level
    lifecycles: int = 400  # per row of the registry and scale sections
    registry_concurrency: tuple[int, ...] = (1, 16, 64)
    scale_rounds: int = 30  # interleaved rounds of fetch_many against the same fetches in flight
    scale_batch: int = 32  # requests per fetch_many
    ingress_lifecycles: int = 300  # per variant, path, concurrency and round
    ingress_concurrency: tuple[int, ...] = (16, 64)  # the targets are judged at the first
    ingress_rounds: int = 3
    memory_burst: int = 32  # requests in each memory burst
    e2e_concurrency: tuple[int, ...] = (1, 4, 16, 64)
    e2e_dtype: str = "bfloat16"  # of the end-to-end towers
    e2e_window_s: float = 3.5  # measured window per concurrency level and path (after a warm-up)
    e2e_warmup_s: float = 1.5
    e2e_warmup_images: int = 8  # per path and model, sent before anything is timed (a full batch warms its shape)
    inprocess_s: float = 3.0  # seconds of the in-process baseline, each time
    image_pool: int = 512  # distinct images cycled through by the end-to-end clients
    blocking_cleanup: bool = True  # wait for apps no longer needed to be deleted before measuring on


QUICK = Plan(
    mode="quick", fetch_rounds=2, staging_rounds=2, raw_calls=300, lifecycles=40, registry_concurrency=(16,),
    scale_rounds=2, scale_batch=4, ingress_lifecycles=40, ingress_concurrency=(16,), ingress_rounds=1, memory_burst=8,
    # Concurrency 1 is also the in-process batch; float32, as a CPU replica serves (dtype auto): on a CPU
    # without bfloat16 instructions a bf16 ViT-B pass takes about a second per image, 4-5 x float32's time.
    e2e_concurrency=(1,), e2e_dtype="float32", e2e_window_s=1.0, e2e_warmup_s=0.2, e2e_warmup_images=1,
    inprocess_s=0.3, image_pool=32, blocking_cleanup=False)


@dataclasses.dataclass
class Context:
    """What every section gets: the plan, the results so far, the cluster and the probe actors."""

    plan: Plan
    results: Results
    namespace: str
    http_url: str
    token: str  # per-run suffix of every name this run creates
    peer: Any = None  # benchmarks.decoder_side.Peer (None when no section needs the probes)
    ranks: list[Any] = dataclasses.field(default_factory=list)  # benchmarks.decoder_side.Rank, RECEIVE_COUNT of them
    app: Any = None  # benchmarks.standin.StandInApp: the stand-in app with the default batched calls
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def name(self, base: str) -> str:
        return f"{base}_{self.token}"

    def step(self, label: str) -> None:
        """A progress line on stderr."""
        print(f"[{time.perf_counter() - self.started:6.1f} s] {label}", file=sys.stderr, flush=True)


# section -> "module:function" that runs it, in the report's order (imported on first use).
SECTIONS = {
    "fetch": "benchmarks.decoder_side:run",
    "staging": "benchmarks.object_store:run_staging",
    "registry": "benchmarks.registry_load:run_registry",
    "scale": "benchmarks.registry_load:run_scale",
    "ingress": "benchmarks.registry_load:run_ingress",
    "memory": "benchmarks.object_store:run_memory",
    "e2e": "benchmarks.end_to_end:run",
}
_STANDIN = {"fetch", "staging", "registry", "scale", "ingress", "memory"}  # the sections that use the stand-in app
DEFAULT_OUT = os.path.join("benchmarks", "results")


def _section(name: str) -> Callable[[Context], None]:
    module, function = SECTIONS[name].split(":")
    return getattr(importlib.import_module(module), function)


def _deploy(ctx: Context, sections: tuple[str, ...]) -> None:
    """Every app the sections need, at once (then left idle until the end: deleting one costs more than it idles)."""
    from ray import serve
    from ray.serve import RunTarget

    from benchmarks import end_to_end, standin
    from benchmarks.object_store import STAGING_SIZES

    targets = []
    if _STANDIN & set(sections):
        for variant, overrides in standin.VARIANTS.items():
            if variant == "batched" or "ingress" in sections:
                app = standin.application(STAGING_SIZES, ctx.name(f"bench_{variant}_registry"), ctx.namespace, **overrides)
                targets.append(RunTarget(app, name=standin.app_name(variant), route_prefix=f"/{standin.app_name(variant)}"))
    if "e2e" in sections:
        for model in end_to_end.MODELS:
            app = end_to_end.app_name(model)
            targets.append(RunTarget(end_to_end.application(ctx, model), name=app, route_prefix=f"/{app}"))
    serve.run_many(targets)
    if _STANDIN & set(sections):
        ctx.app = standin.connect(ctx.name("bench_batched_registry"), ctx.namespace)


def _retire_standin(ctx: Context) -> None:
    """Remove the stand-in apps, their registries and the probes once no section needs them."""
    from ray import serve

    from benchmarks import standin

    for variant in standin.VARIANTS:
        with contextlib.suppress(ValueError):  # ValueError: that variant was not deployed
            ray.kill(ray.get_actor(ctx.name(f"bench_{variant}_registry"), namespace=ctx.namespace))
            serve.delete(standin.app_name(variant), _blocking=ctx.plan.blocking_cleanup)
    for actor in (ctx.peer, *ctx.ranks):
        ray.kill(actor)


def run(plan: Plan, sections: tuple[str, ...]) -> dict[str, Any]:
    """Run ``sections``; return the results document (``benchmarks.report``)."""
    token, results, errors = run_token(), Results(), {}
    started, wall, load_at_start = datetime.datetime.now(datetime.timezone.utc), time.perf_counter(), load_average()
    print("starting a local Ray cluster", file=sys.stderr, flush=True)
    with local_cluster(f"epd-bench-{token}") as cluster:
        ctx = Context(plan, results, cluster["namespace"], "", token)
        if _STANDIN & set(sections):
            from benchmarks import decoder_side

            ctx.peer, ctx.ranks = decoder_side.start(RECEIVE_COUNT, list(SIZES))
        ctx.http_url = start_serve()["http_url"]
        _deploy(ctx, sections)
        ctx.step("apps deployed")
        for name in sections:
            if name == "e2e" and _STANDIN & set(sections):
                _retire_standin(ctx)
            try:
                _section(name)(ctx)
            except Exception:  # noqa: BLE001 - recorded; the other sections still run
                errors[name] = traceback.format_exc()
                print(f"\nsection {name} failed:\n{errors[name]}", file=sys.stderr)
    info = {**machine(), "load_avg_at_start": load_at_start, "load_avg_at_end": load_average()}
    return {"tool": "python -m benchmarks" + (" --quick" if plan.mode == "quick" else ""), "mode": plan.mode,
            "sections": list(sections), "started_at": started.isoformat(timespec="seconds"),
            "wall_s": time.perf_counter() - wall, "machine": info, "cluster": cluster, "plan": dataclasses.asdict(plan),
            "figures": results.figures, "targets": results.targets, "notes": results.notes, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(
        __doc__, argv,
        quick=dict(action="store_true", help="the CI smoke run: every figure, few samples (1-3 minutes)"),
        out=dict(default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})"),
        sections=dict(default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)"),
    )
    requested = set(filter(None, args.sections.split(",")))
    if not requested or requested - set(SECTIONS):
        sys.exit(f"unknown or no sections {sorted(requested - set(SECTIONS))}; choose from {','.join(SECTIONS)}")
    doc = run(QUICK if args.quick else Plan(), tuple(s for s in SECTIONS if s in requested))
    write(doc, args.out)
    met = sum(t["met"] for t in doc["targets"])
    print(f"{met}/{len(doc['targets'])} targets met in {doc['wall_s']:.0f} s; results in {os.path.abspath(args.out)}",
          file=sys.stderr)
    return 1 if doc["errors"] else 0
