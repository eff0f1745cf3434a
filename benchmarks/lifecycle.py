"""3. Registry: full lifecycles per second, against the raw pipelined rate of a no-op async actor.

A lifecycle is what one request costs the registry: ``submit`` (accept, then the
registry's own call to the encoder), ``receive_count`` = 4 rank fetches, and the
release, which happens inside the last fetch (no separate call). ``lifecycles``
new req_ids are run at once by five client processes, as in production: the
driver submits them (``wait=False``) and each of 4 rank processes (``RankProbe``)
fetches all of them with ``EmbeddingReceiver.fetch_async``; every client keeps
``concurrency`` calls in flight. A fetch that arrives before its request is
staged waits inside the registry on an event, as real ranks' would. Items come
from the stand-in encoder (``benchmarks.standin``: 8 KB, free to compute), so the
registry, not a model, is measured. The rate is lifecycles / the time until every
rank has fetched every request.

The raw rate is the driver making ``await noop.ping.remote()`` calls to an async
actor at the same concurrency. Beside it, for the diagnosis (not the target):
``serve_calls_per_s``, the pipelined rate of no-op Serve handle calls to the
stand-in encoder made from an async actor's loop, as the registry makes its one
encoder call per lifecycle; ``lifecycles_vs_raw_with_serve_call`` compares the
lifecycle rate with what that many actor calls plus one Serve call allow. Registry calls per lifecycle are *counted*, not
assumed: the registry process's executed-task counter (read from its raylet)
before and after the timed lifecycles. Polling would show as more calls than
``receive_count + 1``.

Target: lifecycles/s >= 0.8 x raw calls/s / calls per lifecycle, at the highest
concurrency, with the minimum number of calls. For the diagnosis, the CPU seconds
each process spent per lifecycle and per raw call at that concurrency
(``benchmarks.cpu``): on 2 cores, CPU per unit of work bounds the rate. Fetches
that fail are counted (``fetch_errors``, normally 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from benchmarks import standin
from benchmarks.ray_internals import executed_tasks
from benchmarks.cpu import CpuMeter, by_title
from benchmarks.plan import Context, Plan
from benchmarks.probes import pipelined
from registry import media_input

SECTION = "registry"
RECEIVE_COUNT = 4
RAW_ROLES = ("peer", "driver", "other", "all")
LIFECYCLE_ROLES = ("registry", "encoder", "ranks", "driver", "controller", "raylet", "gcs", "other", "all")


def steps(plan: Plan) -> int:
    return 2 * len(plan.lifecycle_concurrency)


def _lifecycles(app: standin.StandInApp, ranks: list, count: int, concurrency: int) -> tuple[float, dict[str, int]]:
    """Run ``count`` lifecycles; (lifecycles per second, fetch errors by type)."""
    req_ids = [uuid.uuid4().hex for _ in range(count)]
    submits = iter(req_ids)

    async def submit() -> None:
        req_id = next(submits)
        await app.registry.submit.remote(req_id, [media_input(standin.media(standin.TINY, req_id))], req_id, RECEIVE_COUNT, False)

    start = time.perf_counter()
    fetching = [rank.fetch_many.remote(req_ids, concurrency) for rank in ranks]
    asyncio.run(pipelined(submit, count, concurrency))
    errors: dict[str, int] = {}
    for out in ray.get(fetching):
        for name, n in out.items():
            errors[name] = errors.get(name, 0) + n
    return count / (time.perf_counter() - start), errors


@dataclasses.dataclass
class _Measured:
    """What the timed loop found, keyed by concurrency where it has one."""

    raw_keys: dict[int, str] = dataclasses.field(default_factory=dict)
    life_keys: dict[int, str] = dataclasses.field(default_factory=dict)
    calls_per: list[float] = dataclasses.field(default_factory=list)
    errors: dict[str, int] = dataclasses.field(default_factory=dict)


def run(ctx: Context, app: standin.StandInApp) -> None:
    ranks = ctx.probes.ranks[:RECEIVE_COUNT]
    if len(ranks) < RECEIVE_COUNT:
        raise RuntimeError(f"the registry section needs {RECEIVE_COUNT} rank processes, got {len(ranks)}")
    ray.get([rank.use_registry.remote(app.registry_name, app.namespace) for rank in ranks])
    classify_raw, classify_life = _classifiers(ctx, app, ranks)
    asyncio.run(pipelined(_raw_call(ctx), 200, 16))  # warm-up: connections, workers, code paths
    _lifecycles(app, ranks, 20, 16)
    measured = _measure(ctx, app, ranks, classify_raw, classify_life)
    _record(ctx, measured)


def _raw_call(ctx: Context) -> Callable[[], Awaitable[None]]:
    noop = ctx.probes.noop

    async def raw_call() -> None:
        await noop.ping.remote()

    return raw_call


def _classifiers(ctx: Context, app: standin.StandInApp, ranks: list) -> tuple[Any, Any]:
    """Which process plays which role, for the raw calls and for the lifecycles."""
    rank_pids = ray.get([rank.pid.remote() for rank in ranks])
    classify_raw = by_title({}, {ray.get(ctx.probes.noop.pid.remote()): "peer"})
    classify_life = by_title(
        {
            f"ServeReplica:{standin.APP}:Encoder": "encoder",
            "ServeController": "controller",
            "raylet/raylet": "raylet",
            "gcs_server": "gcs",
        },
        {ray.get(app.registry.ping.remote())["pid"]: "registry", **dict.fromkeys(rank_pids, "ranks")},
    )
    return classify_raw, classify_life


def _measure(ctx: Context, app: standin.StandInApp, ranks: list, classify_raw: Any, classify_life: Any) -> _Measured:
    plan, results, registry = ctx.plan, ctx.results, app.registry
    out = _Measured()
    top = max(plan.lifecycle_concurrency)
    for concurrency in plan.lifecycle_concurrency:
        labels = {"concurrency": concurrency}
        with CpuMeter(classify_raw) as raw_cpu:
            rate = asyncio.run(pipelined(_raw_call(ctx), plan.raw_calls, concurrency))
        out.raw_keys[concurrency] = results.add(SECTION, "raw_calls_per_s", rate, "1/s", labels, n=plan.raw_calls)
        ctx.progress.step(f"registry: raw calls x{concurrency}")
        before = executed_tasks(registry)
        with CpuMeter(classify_life) as life_cpu:
            rate, failed = _lifecycles(app, ranks, plan.lifecycles, concurrency)
        out.calls_per.append((executed_tasks(registry) - before) / plan.lifecycles)
        for name, n in failed.items():
            out.errors[name] = out.errors.get(name, 0) + n
        out.life_keys[concurrency] = results.add(SECTION, "lifecycles_per_s", rate, "1/s", labels, n=plan.lifecycles)
        ctx.progress.step(f"registry: lifecycles x{concurrency}")
        if concurrency == top:  # where the CPU went, at the concurrency the target is judged at
            for name, meter, roles, n in (
                ("cpu_s_per_raw_call", raw_cpu, RAW_ROLES, plan.raw_calls),
                ("cpu_s_per_lifecycle", life_cpu, LIFECYCLE_ROLES, plan.lifecycles),
            ):
                for role in roles:
                    labels = {"concurrency": top, "process": role}
                    results.add(SECTION, name, meter.by_role.get(role, 0.0) / n, "s", labels, n=n)
    return out


def _record(ctx: Context, measured: _Measured) -> None:
    plan, results = ctx.plan, ctx.results
    top = max(plan.lifecycle_concurrency)
    serve_rate = ray.get(ctx.probes.noop.serve_calls_per_s.remote(standin.APP, "Encoder", plan.raw_calls, top))
    serve_key = results.add(SECTION, "serve_calls_per_s", serve_rate, "1/s", {"concurrency": top}, n=plan.raw_calls)
    calls = max(measured.calls_per)
    total = len(measured.calls_per) * plan.lifecycles
    calls_key = results.add(SECTION, "registry_calls_per_lifecycle", calls, "calls", n=total)
    results.add(SECTION, "fetch_errors", sum(measured.errors.values()), "calls", n=total * RECEIVE_COUNT)
    life_key, raw_key = measured.life_keys[top], measured.raw_keys[top]
    raw, life = results.value(raw_key), results.value(life_key)
    value = results.ratio(
        SECTION,
        "lifecycles_vs_raw_per_call",
        life * calls,
        raw,
        [life_key, raw_key, calls_key],
        {"concurrency": top},
        how="lifecycles/s x registry calls per lifecycle / raw no-op calls/s",
    )
    # Not a target, a diagnosis: each lifecycle also needs the registry's one Serve
    # call to the encoder, whose no-op rate is measured the same way.
    results.ratio(
        SECTION,
        "lifecycles_vs_raw_with_serve_call",
        life,
        1 / (calls / raw + 1 / serve_rate),
        [life_key, raw_key, calls_key, serve_key],
        {"concurrency": top},
        how="lifecycles/s / (1 / (registry calls per lifecycle / raw calls/s + 1 / no-op Serve calls/s))",
    )
    _targets_and_note(ctx, value, calls, [life_key, raw_key, calls_key], calls_key, measured.errors)


def _targets_and_note(ctx: Context, value: float, calls: float, inputs: list, calls_key: str, errors: dict) -> None:
    results, top = ctx.results, max(ctx.plan.lifecycle_concurrency)
    results.target(
        SECTION,
        "lifecycles_vs_raw_per_call",
        value,
        ">=",
        0.8,
        "lifecycles/s >= 80% of (raw no-op calls/s / registry calls per lifecycle)",
        {"concurrency": top},
        inputs,
    )
    results.target(
        SECTION,
        "registry_calls_per_lifecycle",
        calls,
        "<=",
        RECEIVE_COUNT + 1,
        f"the minimum: 1 submit + receive_count ({RECEIVE_COUNT}) fetches, release inside the last (no polling)",
        inputs=[calls_key],
    )
    results.note(
        SECTION,
        (
            f"receive_count={RECEIVE_COUNT}; the driver submits and {RECEIVE_COUNT} rank processes fetch, each with "
            "`concurrency` calls in flight; stand-in encoder (8 KB items, no compute). Every lifecycle also "
            "includes the registry's own Serve call to the encoder, which the raw no-op rate does not. Calls "
            f"counted from the registry process's executed-task counter. Fetch errors: {errors or 'none'}."
        ),
    )
