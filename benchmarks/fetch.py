"""1. Fetch: a TP rank's ``EmbeddingReceiver.fetch`` of a staged embedding, to a usable bf16 tensor.

Measured, for 0.52, 4.72 and 18.87 MB embeddings (64, 576 and 2304 tokens x 4096
bfloat16), from rank processes (``RankProbe`` actors, ``plan.fetch_ranks`` of them):

* ``registry_fetch_s``: ``EmbeddingReceiver(rank).fetch(req_id)`` until ``items[0].tensor``
  exists. Each entry is staged by the project's registry (which calls the stand-in
  encoder, see ``benchmarks.standin``, and owns the result) with ``receive_count`` =
  number of ranks; the ranks then fetch it one after another, so every sample is one
  process's first read of a fresh object, and the last fetch releases the entry. The
  tensor is checked to be bfloat16 and to lie in the object store's shared memory
  (zero-copy).
* ``zmq_s``: the SGLang-style baseline, in the same rank process: ask a sender actor
  for the same number of bytes over a ZMQ PUSH socket, receive them on a PULL socket
  (TCP on 127.0.0.1, no pickling) and view them as a bf16 tensor.
* ``memcpy_warm_s`` / ``memcpy_fresh_s``: one memcpy of the same bytes in the rank
  process, into a reused buffer / into never-touched pages.
* ``actor_rtt_s``: one round trip from the rank process to a no-op async actor.

All four are interleaved, round by round, after one untimed warm-up round.
Targets: p50 fetch <= 1.5 x (p50 round trip + p50 warm memcpy), and p50 fetch <
p50 ZMQ at 4.7 MB and above.
"""

from __future__ import annotations

import ray

from benchmarks import standin
from benchmarks.plan import SIZES, Context, Plan
from benchmarks.stats import size_label

SECTION = "fetch"
_RTT_PER_ROUND = 5
_MEMCPY_PER_ROUND = 3


def steps(plan: Plan) -> int:
    return len(SIZES) * (plan.fetch_rounds + 1)


def run(ctx: Context, app: standin.StandInApp) -> None:
    plan, results, probes = ctx.plan, ctx.results, ctx.probes
    ranks = probes.ranks[: plan.fetch_ranks]
    ray.get([rank.use_registry.remote(app.registry_name, app.namespace) for rank in ranks])
    for nbytes in SIZES:
        _record(ctx, nbytes, _measure_size(ctx, app, ranks, probes.noop, nbytes))
    results.note(
        SECTION,
        (
            f"Entries staged by the registry through the stand-in encoder, receive_count={plan.fetch_ranks}; "
            f"{plan.fetch_ranks} rank processes fetch each entry in turn (every sample is a first read of a fresh "
            "object by that process). Baselines timed in the same rank processes, interleaved round by round."
        ),
    )


def _measure_size(ctx: Context, app: standin.StandInApp, ranks: list, noop, nbytes: int) -> dict[str, list]:
    plan = ctx.plan
    samples: dict[str, list] = {k: [] for k in ("fetch", "zmq", "rtt", "warm", "fresh", "bf16", "zero_copy")}
    for round_index in range(plan.fetch_rounds + 1):
        timed = round_index > 0  # round 0 warms up every path
        req_id, _ = app.submit(nbytes, receive_count=len(ranks))
        fetched = [ray.get(rank.fetch.remote(req_id)) for rank in ranks]  # one at a time
        zmq = [ray.get(rank.zmq_fetch.remote(nbytes)) for rank in ranks]
        rtt = ray.get([rank.rtt.remote(noop, _RTT_PER_ROUND) for rank in ranks])
        copies = ray.get([rank.memcpy.remote(nbytes, _MEMCPY_PER_ROUND) for rank in ranks])
        for out in (*fetched, *zmq):
            if out["nbytes"] != nbytes:
                raise RuntimeError(f"expected {nbytes} bytes, got {out['nbytes']}")
        if timed:
            samples["fetch"] += [f["s"] for f in fetched]
            samples["bf16"] += [f["bf16"] for f in fetched]
            samples["zero_copy"] += [f["zero_copy"] for f in fetched]
            samples["zmq"] += [z["s"] for z in zmq]
            samples["rtt"] += [s for per_rank in rtt for s in per_rank]
            samples["warm"] += [s for c in copies for s in c["warm"]]
            samples["fresh"] += [s for c in copies for s in c["fresh"]]
        ctx.progress.step(f"fetch {size_label(nbytes)} MB")
    return samples


def _record(ctx: Context, nbytes: int, samples: dict[str, list]) -> None:
    results = ctx.results
    labels = {"size_mb": size_label(nbytes)}
    fetch = results.add_samples(SECTION, "registry_fetch_s", samples["fetch"], "s", labels)
    zmq = results.add_samples(SECTION, "zmq_s", samples["zmq"], "s", labels)
    rtt = results.add_samples(SECTION, "actor_rtt_s", samples["rtt"], "s", labels)
    warm = results.add_samples(SECTION, "memcpy_warm_s", samples["warm"], "s", labels)
    results.add_samples(SECTION, "memcpy_fresh_s", samples["fresh"], "s", labels)
    results.add(SECTION, "size_bytes", nbytes, "B", labels)
    bound = results.value(rtt) + results.value(warm)
    vs_bound = results.ratio(
        SECTION,
        "fetch_vs_rtt_plus_memcpy",
        results.value(fetch),
        bound,
        [fetch, rtt, warm],
        labels,
        how="p50 fetch / (p50 round trip + p50 warm memcpy)",
    )
    vs_zmq = results.ratio(
        SECTION,
        "fetch_vs_zmq",
        results.value(fetch),
        results.value(zmq),
        [fetch, zmq],
        labels,
        how="p50 fetch / p50 ZMQ PUSH/PULL",
    )
    _targets(ctx, nbytes, labels, samples, vs_bound, vs_zmq, (fetch, zmq, rtt, warm))


def _targets(
    ctx: Context, nbytes: int, labels: dict, samples: dict[str, list], vs_bound: float, vs_zmq: float, keys: tuple
) -> None:
    results = ctx.results
    fetch, zmq, rtt, warm = keys
    results.target(
        SECTION,
        "fetch_vs_rtt_plus_memcpy",
        vs_bound,
        "<=",
        1.5,
        "p50 fetch <= 1.5 x (one async actor round trip + one memcpy)",
        labels,
        [fetch, rtt, warm],
    )
    if nbytes >= 4_700_000:
        results.target(
            SECTION,
            "fetch_vs_zmq",
            vs_zmq,
            "<",
            1.0,
            "p50 fetch faster than ZMQ PUSH/PULL at 4.7 MB and above",
            labels,
            [fetch, zmq],
        )
    kept = all(samples["bf16"]) and all(samples["zero_copy"])
    results.target(
        SECTION,
        "bf16_zero_copy",
        1.0 if kept else 0.0,
        "==",
        1.0,
        "every fetched tensor is bfloat16 and a view of the object store (no copy)",
        labels,
        [fetch],
    )
