"""2. Staging: from the encoder's output tensor to a staged, registry-owned object, per MB.

Method. The registry stages an item by calling the ``Encoder`` deployment and
keeping the ref of the returned ``EncodedItem``; Ray writes the returned payload
into the object store (the one copy after the forward pass). To time only that,
the registry (the project's own actor, created by the app's Ingress) calls the
stand-in encoder (``benchmarks.standin``: the real ``Encoder`` code with a free
forward pass), and the driver times ``submit(wait=True)``: fixed overheads (round
trips, the Serve call, thread hops) plus the staging of the bytes. Each round
submits an 8 KB item, which travels inline and touches no object store, then
every size in a new order; ``staging_extra_s`` is a submit minus that round's
inline submit (pairs share the machine's load of the moment), its p50 over the
rounds. Entries are cancelled after each submit (untimed). Side by side, in the
stand-in replica's own process: ``put_s`` (``ray.put`` of the same payload) and
``memcpy_warm_s`` / ``memcpy_fresh_s`` (a memcpy of it into a reused buffer /
into never-touched pages). Sizes: 0.52, 4.72, 18.87 MB and 75.50 MB, the last a
long lever for the slope.

Per MB is the slope of a least-squares line through the sizes' p50s
(``*_s_per_mb``), so fixed costs drop out; the target compares the staging
slope with the ``ray.put`` slope (<= 1.2: no more than one copy of the bytes),
and ``copies_before_store`` checks that building the item copies nothing.

Steady state reuses object-store pages freed by earlier objects. The *cold*
burst, run first (the runner runs this section before any other touches the
store), holds ``plan.staging_cold_items`` 4.72 MB entries at once, then as many
held ``ray.put``s, so that each lands in pages never touched before. The whole
section also runs (``Prefaulted``; figures labelled ``prealloc=on``) on a second
node of the same cluster, on this machine, whose raylet pre-faulted its object
store at start (``RAY_preallocate_plasma_memory=1``): the stand-in encoder and a
registry of its own run there, and the driver calls that registry as before.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
from typing import Any

import numpy as np
import ray
from ray import serve

from benchmarks import standin
from benchmarks.cluster import PREFAULTED_STORE_BYTES, start_prefaulted_node
from benchmarks.ray_internals import remove_node
from benchmarks.plan import SIZES, Context, Plan
from benchmarks.stats import Results, figure_id, size_label

SECTION = "staging"
COLD_SIZE = SIZES[1]
# The fetch sizes plus 75.5 MB (9216 tokens x 4096): a long lever for the per-MB slope,
# whose small sizes sit within the noise of a call that itself takes milliseconds.
STAGING_SIZES = (*SIZES, 9216 * 8192)
PREFAULTED_RESOURCE = "bench_prefaulted_store"
PREFAULTED_APP = "bench-standin-prefaulted"
_MB = 1e6


def steps(plan: Plan) -> int:
    return 2 * (plan.staging_rounds + 2)  # the head node's store, then the pre-faulted one


def measure(plan: Plan, app: standin.StandInApp, tick=lambda label: None) -> dict[str, Any]:
    """Raw samples (seconds) by kind and size; the caller turns them into figures.

    Run before any other section touches the object store, so that the cold burst
    lands in pages never used before.
    """
    for _ in range(3):  # warm-up of the call path; inline items touch no store pages
        app.cancel(app.submit(standin.TINY, receive_count=1)[0])
    cold_extra, cold_put = _cold_burst(plan, app)
    tick("staging: cold burst")
    steady = _steady_state(plan, app, tick)
    copies = app.encoder.copies_before_store.remote(COLD_SIZE).result()
    return {**steady, "cold_extra": cold_extra, "cold_put": cold_put, "copies_before_store": copies}


def _cold_burst(plan: Plan, app: standin.StandInApp) -> tuple[list[float], list[float]]:
    """Entries held, so each lands in fresh pages; then as many held puts on top."""
    held, cold_extra, cold_put = [], [], []
    for _ in range(plan.staging_cold_items):
        inline_id, inline_s = app.submit(standin.TINY, receive_count=1)
        app.cancel(inline_id)
        req_id, seconds = app.submit(COLD_SIZE, receive_count=1)
        held.append(req_id)
        cold_extra.append(seconds - inline_s)
    for _ in range(plan.staging_cold_items):
        cold_put.append(app.encoder.put.remote(COLD_SIZE, hold=True).result())
    for req_id in held:
        app.cancel(req_id)
    app.encoder.release.remote().result()
    return cold_extra, cold_put


def _steady_state(plan: Plan, app: standin.StandInApp, tick) -> dict[str, Any]:
    """Each round one inline submit, then every size in a new order, each submit paired with
    that round's inline one (load drifts; pairs drift together)."""
    inline: list[float] = []
    kinds = ("submit", "extra", "put", "warm", "fresh")
    samples: dict[str, dict[int, list[float]]] = {kind: {n: [] for n in STAGING_SIZES} for kind in kinds}
    order = random.Random(0)
    for round_index in range(plan.staging_rounds + 1):
        timed = round_index > 0  # round 0 warms every size up
        inline_id, inline_s = app.submit(standin.TINY, receive_count=1)
        app.cancel(inline_id)
        if timed:
            inline.append(inline_s)
        for nbytes in order.sample(STAGING_SIZES, len(STAGING_SIZES)):
            req_id, seconds = app.submit(nbytes, receive_count=1)
            app.cancel(req_id)
            put_s = app.encoder.put.remote(nbytes).result()
            copy = app.encoder.memcpy.remote(nbytes).result()
            if timed:
                for kind, value in (("submit", seconds), ("extra", seconds - inline_s), ("put", put_s),
                                    ("warm", copy["warm"]), ("fresh", copy["fresh"])):
                    samples[kind][nbytes].append(value)
        tick("staging: steady state")
    return {"inline": inline, **samples}


def _slope(points: dict[int, list[float]]) -> float:
    """Seconds per MB: least-squares slope through (size, p50) of the object-store sizes."""
    x = np.array([n / _MB for n in STAGING_SIZES])
    y = np.array([float(np.percentile(_get(points, n), 50)) for n in STAGING_SIZES])
    return float(np.polyfit(x, y, 1)[0])


def record(results: Results, samples: dict[str, Any], prealloc: bool) -> None:
    """Figures, ratios and (for the default store, without pre-faulting) the targets."""
    base = {"prealloc": "on" if prealloc else "off"}
    results.add_samples(SECTION, "submit_s", samples["inline"], "s", {**base, "size_mb": size_label(standin.TINY)})
    for nbytes in STAGING_SIZES:
        labels = {**base, "size_mb": size_label(nbytes)}
        results.add_samples(SECTION, "submit_s", _get(samples["submit"], nbytes), "s", labels)
        extra = results.add_samples(SECTION, "staging_extra_s", _get(samples["extra"], nbytes), "s", labels)
        put = results.add_samples(SECTION, "put_s", _get(samples["put"], nbytes), "s", labels)
        results.add_samples(SECTION, "memcpy_warm_s", _get(samples["warm"], nbytes), "s", labels)
        results.add_samples(SECTION, "memcpy_fresh_s", _get(samples["fresh"], nbytes), "s", labels)
        results.ratio(
            SECTION,
            "staging_vs_put",
            results.value(extra),
            results.value(put),
            [extra, put],
            labels,
            how="p50 of (submit - the same round's inline submit) / p50 ray.put, this size",
        )
    ratio, slopes = _record_slopes(results, samples, base)
    _record_cold(results, samples, base)
    if not prealloc:
        _record_targets(results, samples, base, ratio, slopes)


def _record_slopes(results: Results, samples: dict[str, Any], base: dict[str, str]) -> tuple[float, dict[str, str]]:
    """Per-MB costs (slopes over the sizes), and staging's against ``ray.put``'s and memcpy's."""
    slopes = {}
    for kind, name in (
        ("extra", "staging_s_per_mb"),
        ("put", "put_s_per_mb"),
        ("warm", "memcpy_warm_s_per_mb"),
        ("fresh", "memcpy_fresh_s_per_mb"),
    ):
        slopes[kind] = results.add(
            SECTION,
            name,
            _slope(samples[kind]),
            "s/MB",
            base,
            n=sum(len(_get(samples[kind], n)) for n in STAGING_SIZES),
        )
    ratio = results.ratio(
        SECTION,
        "staging_per_mb_vs_put",
        results.value(slopes["extra"]),
        results.value(slopes["put"]),
        [slopes["extra"], slopes["put"]],
        base,
        how="slope of staging p50s / slope of ray.put p50s",
    )
    results.ratio(
        SECTION,
        "staging_per_mb_vs_memcpy",
        results.value(slopes["extra"]),
        results.value(slopes["warm"]),
        [slopes["extra"], slopes["warm"]],
        base,
        how="staging slope / warm memcpy slope: copies' worth",
    )
    return ratio, slopes


def _record_cold(results: Results, samples: dict[str, Any], base: dict[str, str]) -> None:
    """The cold burst: staging into fresh pages, against ``ray.put`` into fresh and reused ones."""
    cold = {**base, "size_mb": size_label(COLD_SIZE)}
    cold_extra = results.add_samples(SECTION, "cold_staging_extra_s", samples["cold_extra"], "s", cold)
    cold_put = results.add_samples(SECTION, "cold_put_s", samples["cold_put"], "s", cold)
    results.ratio(
        SECTION,
        "cold_staging_vs_put",
        results.value(cold_extra),
        results.value(cold_put),
        [cold_extra, cold_put],
        cold,
        how="cold burst: p50 paired staging extra / p50 held ray.put",
    )
    put_warm = figure_id(f"{SECTION}.put_s", cold)
    results.ratio(
        SECTION,
        "cold_put_vs_warm_put",
        results.value(cold_put),
        results.value(put_warm),
        [cold_put, put_warm],
        cold,
        how="first-touch cost: p50 put into fresh pages / p50 put into reused pages",
    )


def _record_targets(
    results: Results, samples: dict[str, Any], base: dict[str, str], ratio: float, slopes: dict[str, str]
) -> None:
    """The targets, judged on the default store (without pre-faulting)."""
    results.target(
        SECTION,
        "staging_per_mb_vs_put",
        ratio,
        "<=",
        1.2,
        "staging costs no more than one copy per MB: <= 1.2 x ray.put of the same bytes",
        base,
        [slopes["extra"], slopes["put"]],
    )
    results.target(
        SECTION,
        "copies_before_store",
        float(samples["copies_before_store"]),
        "==",
        0.0,
        "building the staged item from the output tensor copies nothing (the store write is the one copy)",
        base,
    )


def _get(table: dict, nbytes: int) -> list[float]:
    return table[nbytes] if nbytes in table else table[str(nbytes)]  # JSON keys come back as strings


def run(ctx: Context, app: standin.StandInApp) -> None:
    record(ctx.results, measure(ctx.plan, app, ctx.progress.step), prealloc=False)


class Prefaulted:
    """The section again, on a node whose object store was pre-faulted at start (``prealloc=on``).

    Created, the node and the stand-in app on it start in a thread; ``run`` waits for
    them, measures, and removes them (``close`` also does, if ``run`` never ran). The
    runner creates it right before ``run`` in the default mode; in ``--quick``, after
    the first staging run, so that the set-up overlaps the fetch, registry and memory
    sections (their figures are then perturbed, which a smoke run does not mind).
    """

    def __init__(self, ctx: Context):
        self._ctx = ctx
        self._node: Any = None
        self._app: standin.StandInApp | None = None
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._closed = threading.Event()
        threading.Thread(target=self._hold_node, name="prefaulted-node", daemon=True).start()

    def _hold_node(self) -> None:
        """Start the node and the app, then stay alive until ``close``: the node's processes
        get the kernel's parent-death signal when the *thread* that started them ends."""
        try:
            self._node = start_prefaulted_node(PREFAULTED_RESOURCE)
            name = self._ctx.name("bench_prefaulted_registry")
            self._app = standin.deploy_on(
                PREFAULTED_RESOURCE, list(STAGING_SIZES), name, self._ctx.cluster["namespace"], PREFAULTED_APP
            )
        except BaseException as exc:  # noqa: BLE001 - handed to run()
            self._ready.set_exception(exc)
        else:
            self._ready.set_result(None)
        self._closed.wait()

    def run(self) -> None:
        ctx = self._ctx
        try:
            self._ready.result(timeout=300)
            assert self._app is not None
            samples = measure(ctx.plan, self._app, ctx.progress.step)
        finally:
            self.close()
        record(ctx.results, samples, prealloc=True)
        ctx.results.note(
            SECTION,
            f"prealloc=on: the stand-in encoder and a registry on a second node of the cluster (this machine) "
            f"whose {PREFAULTED_STORE_BYTES / 2**20:.0f} MiB object store was pre-faulted at start "
            "(RAY_preallocate_plasma_memory=1).",
        )

    def close(self) -> None:
        """Remove the app, its registry and the node (idempotent; waits for a set-up under way)."""
        concurrent.futures.wait([self._ready], timeout=300)
        if self._app is not None:  # before the node goes, or Serve would bring the replica back elsewhere
            ray.kill(self._app.registry)
            serve.delete(PREFAULTED_APP, _blocking=False)  # the node's end stops the replica anyway
            self._app = None
        if self._node is not None:
            remove_node(self._node)
            self._node = None
        self._closed.set()
