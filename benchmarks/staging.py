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
section also runs in a second cluster started with
``RAY_preallocate_plasma_memory=1`` (``python -m benchmarks.staging --child``),
which pre-faults the store at start; its figures carry ``prealloc=on``. In the
default mode it runs after the main cluster is shut down; in ``--quick`` it runs
beside it to save time (its figures are then perturbed, which a smoke run does
not mind).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
from typing import Any

import numpy as np

from benchmarks import standin
from benchmarks.cluster import PREFAULTED_STORE_BYTES, local_cluster
from benchmarks.plan import SIZES, Context, Plan
from benchmarks.stats import Results, figure_id, size_label

SECTION = "staging"
COLD_SIZE = SIZES[1]
# The fetch sizes plus 75.5 MB (9216 tokens x 4096): a long lever for the per-MB slope,
# whose small sizes sit within the noise of a call that itself takes milliseconds.
STAGING_SIZES = (*SIZES, 9216 * 8192)
_MB = 1e6


def steps(plan: Plan) -> int:
    return 2 * (plan.staging_rounds + 2)  # this cluster, then the pre-faulted one


def measure(plan: Plan, app: standin.StandInApp, tick=lambda label: None) -> dict[str, Any]:
    """Raw samples (seconds) by kind and size; the caller turns them into figures.

    Run before any other section touches the object store, so that the cold burst
    lands in pages never used before.
    """
    for _ in range(3):  # warm-up of the call path; inline items touch no store pages
        app.cancel(app.submit(standin.TINY, receive_count=1)[0])
    # Cold: entries held, so each lands in fresh pages; then as many held puts on top.
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
    tick("staging: cold burst")
    # Steady state: each round one inline submit, then every size in a new order, each
    # submit paired with that round's inline one (load drifts; pairs drift together).
    inline: list[float] = []
    submit: dict[int, list[float]] = {n: [] for n in STAGING_SIZES}
    extra: dict[int, list[float]] = {n: [] for n in STAGING_SIZES}
    put: dict[int, list[float]] = {n: [] for n in STAGING_SIZES}
    warm: dict[int, list[float]] = {n: [] for n in STAGING_SIZES}
    fresh: dict[int, list[float]] = {n: [] for n in STAGING_SIZES}
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
                submit[nbytes].append(seconds)
                extra[nbytes].append(seconds - inline_s)
                put[nbytes].append(put_s)
                warm[nbytes].append(copy["warm"])
                fresh[nbytes].append(copy["fresh"])
        tick("staging: steady state")
    copies = app.encoder.copies_before_store.remote(COLD_SIZE).result()
    return {
        "inline": inline,
        "submit": submit,
        "extra": extra,
        "put": put,
        "warm": warm,
        "fresh": fresh,
        "cold_extra": cold_extra,
        "cold_put": cold_put,
        "copies_before_store": copies,
    }


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
    if not prealloc:
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


def start_preallocated(plan: Plan, token: str, out_dir: str) -> tuple[subprocess.Popen, str]:
    """Start the same measurements in a fresh cluster whose object store is pre-faulted at start.

    The child runs in a session of its own, so that on failure its whole process group,
    the Ray cluster it started included, can be killed (never ``ray stop``).
    """
    path = os.path.join(out_dir, f"staging_prealloc_{token}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(path + ".log", "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.staging",
                "--child",
                "--mode",
                plan.mode,
                "--out",
                path + ".json",
                "--token",
                token,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, path


def kill_preallocated(started: tuple[subprocess.Popen, str]) -> None:
    try:
        os.killpg(started[0].pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def finish_preallocated(ctx: Context, started: tuple[subprocess.Popen, str]) -> None:
    """Wait for the pre-faulted run and record its figures (``prealloc=on``)."""
    proc, path = started
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        kill_preallocated(started)
        raise
    with open(path + ".log") as f:
        log = f.read()
    if proc.returncode != 0:
        kill_preallocated(started)
        raise RuntimeError(f"the pre-faulted staging run failed (log {path}.log):\n{log[-4000:]}")
    with open(path + ".json") as f:
        samples = json.load(f)
    for suffix in (".json", ".log"):
        os.remove(path + suffix)
    ctx.progress.step("staging: pre-faulted store", n=steps(ctx.plan) // 2)
    record(ctx.results, samples, prealloc=True)
    when = "beside the main cluster" if ctx.plan.prealloc_in_parallel else "after the main cluster was shut down"
    ctx.results.note(
        SECTION,
        f"prealloc=on: a second cluster, {when}, whose {PREFAULTED_STORE_BYTES / 2**20:.0f} MiB object store "
        "was pre-faulted at start (RAY_preallocate_plasma_memory=1).",
    )


def _child(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--mode", choices=["default", "quick"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--token", required=True)
    args = parser.parse_args(argv)
    plan = Plan.quick() if args.mode == "quick" else Plan.default()
    namespace = f"epd-bench-{args.token}-prealloc"
    # Staging calls the registry directly: no Ingress and no HTTP proxy to start.
    with local_cluster(namespace, preallocate=True, http=False, object_store_bytes=PREFAULTED_STORE_BYTES):
        app = standin.deploy_without_ingress(list(STAGING_SIZES), f"bench_registry_{args.token}_prealloc", namespace)
        samples = measure(plan, app)
    with open(args.out, "w") as f:
        json.dump(samples, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(_child(sys.argv[1:]))
