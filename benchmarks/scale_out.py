"""The scale-out figures: the ``scale`` section of ``python -m benchmarks`` (``run``), or
alone on a cluster of its own: ``python -m benchmarks.scale_out``.

On one local cluster with the stand-in encoder (``benchmarks.standin``: 8 KB items,
free to compute, so the registry and the transport are measured, not a model):

* **shards**: full lifecycles (a submit, ``receive_count`` = TP rank fetches, the
  release inside the last) per second with 1, 2 and 4 registry shards at TP 4, and on
  one shard at TP 1, and the CPU seconds per lifecycle of every process, summed and by
  role (``benchmarks.cpu``).
  The driver submits to each request's shard and 4 rank processes fetch every request
  with ``fetch_async``, each keeping ``--concurrency`` calls in flight.
* **fetch_many**: one rank fetching ``--batch`` staged requests with one
  ``fetch_many`` (one registry call per shard) against the same number of
  ``fetch_async`` calls in flight at once, on 4 shards; interleaved, alternating which
  of two ranks does which, per request.
* **paths**: the same lifecycles through the app's ``Ingress``, over HTTP and through the
  Python handle, with the CPU of every process (``benchmarks.service_cpu``).
* **quiet fetch**: a rank's fetch of a freshly staged item of 0.25, 4.7 and 19 MB against
  its no-op actor round trip plus one memcpy of that size, measured round by round on a
  quiet cluster (nothing else in flight), so the baseline is the limit it stands for.

Prints one JSON object. On 2 cores more shards cannot run in parallel with the
ranks and the encoder; what shows there is the CPU per lifecycle, not the scaling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from typing import Any

import ray

from benchmarks import service_cpu, standin
from benchmarks.cpu import by_title
from benchmarks.probes import pipelined
from registry import get_or_create_shards, media_input

RECEIVE_COUNT = 4
SHARD_COUNTS = (1, 2, 4)
ROW = 8192  # one row of a 4096-wide bfloat16 embedding
QUIET_SIZES = (32 * ROW, 576 * ROW, 2304 * ROW)  # 0.26, 4.7 and 19 MB
ROLES = ("registry", "encoder", "ranks", "driver", "controller", "raylet", "gcs", "other", "all")


@ray.remote(num_cpus=0)
class BatchRank:
    """A decoder rank: fetches with ``EmbeddingReceiver`` on its event loop and times it."""

    def __init__(self, rank: int, sizes: tuple[int, ...] = QUIET_SIZES):
        import numpy as np

        self.rank = rank
        self._receiver: Any = None
        self._buffers: dict[int, tuple[Any, Any]] = {n: (np.ones(n, np.uint8), np.ones(n, np.uint8)) for n in sizes}

    def pid(self) -> int:
        return os.getpid()

    def use_registry(self, name: str, namespace: str) -> None:
        from registry import EmbeddingReceiver

        self._receiver = EmbeddingReceiver(self.rank, registry_name=name, registry_namespace=namespace)

    async def fetch_all(self, req_ids: list[str], concurrency: int) -> int:
        """Fetch each of ``req_ids`` with ``concurrency`` in flight; the number that failed."""
        failed, pending = 0, iter(req_ids)

        async def one() -> None:
            nonlocal failed
            try:
                await self._receiver.fetch_async(next(pending), timeout_s=60.0)
            except Exception:  # noqa: BLE001 - counted
                failed += 1

        await pipelined(one, len(req_ids), concurrency)
        return failed

    async def batch(self, req_ids: list[str]) -> float:
        start = time.perf_counter()
        out = await self._receiver.fetch_many_async(req_ids, timeout_s=60.0)
        elapsed = time.perf_counter() - start
        assert all(isinstance(items, list) for items in out.values()), out
        return elapsed

    async def singles(self, req_ids: list[str]) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(self._receiver.fetch_async(r, timeout_s=60.0) for r in req_ids))
        return time.perf_counter() - start

    def round_trip(self, actor: Any) -> float:
        start = time.perf_counter()
        ray.get(actor.ping.remote())
        return time.perf_counter() - start

    def memcpy(self, nbytes: int) -> float:
        import numpy as np

        src, dst = self._buffers[nbytes]
        start = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - start

    def fetch(self, req_id: str) -> float:
        start = time.perf_counter()
        items = self._receiver.fetch(req_id, timeout_s=60.0)
        items[0].tensor.numel()
        return time.perf_counter() - start


@ray.remote(num_cpus=0)
class Noop:
    def ping(self) -> None:
        return None


def _registry(name: str, namespace: str, shards: int) -> Any:
    from deployments import AppConfig

    config = AppConfig(registry_name=name, registry_namespace=namespace, registry_shards=shards, cache_max_bytes=0,
                       model={"family": "tiny-vit", "dtype": "bfloat16"})
    return get_or_create_shards(config.registry_settings(standin.APP))


def submit_all(shards: Any, req_ids: list[str], receive_count: int, concurrency: int, nbytes: int = standin.TINY) -> None:
    submits = iter(req_ids)

    async def submit() -> None:
        req_id = next(submits)
        item = media_input(standin.media(nbytes, req_id))
        await shards.of(req_id).submit.remote(req_id, [item], req_id, receive_count, False)

    asyncio.run(pipelined(submit, len(req_ids), concurrency))


def wait_staged(shards: Any, req_ids: list[str]) -> None:
    """Until every one is staged: the fetches timed after it wait for nothing."""
    ray.get([shards.of(req_id).describe.remote(req_id, 60.0) for req_id in req_ids])


def measure_shards(ranks: list[Any], namespace: str, token: str, lifecycles: int, concurrency: int) -> dict[str, Any]:
    """Per (shards, TP): lifecycles/s and CPU ms per lifecycle by role. TP 1 beside TP 4 on one
    shard splits the registry's CPU into a part per request and a part per rank's fetch."""
    out: dict[str, Any] = {}
    for count, tp in ((1, 1), *((n, RECEIVE_COUNT) for n in SHARD_COUNTS)):
        name = f"scale_{count}_{tp}_{token}"
        shards = _registry(name, namespace, count)
        fetchers = ranks[:tp]
        ray.get([rank.use_registry.remote(name, namespace) for rank in fetchers])
        classify = by_title(
            {f"ServeReplica:{standin.APP}:Encoder": "encoder", "ServeController": "controller",
             "raylet/raylet": "raylet", "gcs_server": "gcs"},
            {**{ping["pid"]: "registry" for ping in ray.get([h.ping.remote() for h in shards.handles])},
             **dict.fromkeys(ray.get([rank.pid.remote() for rank in ranks]), "ranks")},
        )
        def encode(req_ids: list[str]) -> None:
            submit_all(shards, req_ids, tp, concurrency)

        service_cpu.timed_lifecycles(fetchers, max(20, lifecycles // 10), concurrency, classify, encode)  # warm-up
        rate, cpu, failed = service_cpu.timed_lifecycles(fetchers, lifecycles, concurrency, classify, encode)
        out[f"{count} shards, TP {tp}"] = {
            "shards": count, "tp": tp, "lifecycles_per_s": round(rate, 1), "fetch_errors": failed,
            "cpu_ms_per_lifecycle": {role: round(cpu.by_role.get(role, 0.0) / lifecycles * 1e3, 2) for role in ROLES},
        }
        for handle in shards.handles:
            ray.kill(handle)
    return out


def measure_fetch_many(ranks: list[Any], namespace: str, token: str, batch: int, rounds: int) -> dict[str, Any]:
    name = f"scale_many_{token}"
    shards = _registry(name, namespace, max(SHARD_COUNTS))
    pair = ranks[:2]
    ray.get([rank.use_registry.remote(name, namespace) for rank in pair])
    per_batch: list[float] = []
    per_single: list[float] = []
    for r in range(rounds + 1):
        req_ids = [uuid.uuid4().hex for _ in range(batch)]
        submit_all(shards, req_ids, 2, batch)
        wait_staged(shards, req_ids)
        many, single = (pair[0], pair[1]) if r % 2 else (pair[1], pair[0])
        t_many = ray.get(many.batch.remote(req_ids))  # one after the other: each has the machine
        t_single = ray.get(single.singles.remote(req_ids))
        if r:  # round 0 warms both paths up
            per_batch.append(t_many / batch)
            per_single.append(t_single / batch)
    for handle in shards.handles:
        ray.kill(handle)
    many_ms, single_ms = statistics.median(per_batch) * 1e3, statistics.median(per_single) * 1e3
    return {"shards": max(SHARD_COUNTS), "batch": batch, "rounds": rounds, "fetch_many_ms_per_request": round(many_ms, 3),
            "fetch_async_in_flight_ms_per_request": round(single_ms, 3), "fetch_many_vs_singles": round(many_ms / single_ms, 2)}


def measure_quiet_fetch(rank: Any, namespace: str, token: str, rounds: int, sizes: tuple[int, ...] = QUIET_SIZES) -> dict[str, Any]:
    name = f"scale_quiet_{token}"
    shards = _registry(name, namespace, 1)
    ray.get(rank.use_registry.remote(name, namespace))
    noop = Noop.remote()
    out: dict[str, Any] = {}
    for nbytes in sizes:
        trips, copies, fetches = [], [], []
        for r in range(rounds + 3):
            req_id = uuid.uuid4().hex
            submit_all(shards, [req_id], 1, 1, nbytes)
            wait_staged(shards, [req_id])
            trip, copy, fetch = ray.get(rank.round_trip.remote(noop)), ray.get(rank.memcpy.remote(nbytes)), ray.get(rank.fetch.remote(req_id))
            if r >= 3:
                trips.append(trip)
                copies.append(copy)
                fetches.append(fetch)
        trip, copy, fetch = (statistics.median(v) * 1e3 for v in (trips, copies, fetches))
        out[f"{nbytes / 1e6:.2f}MB"] = {"round_trip_ms": round(trip, 3), "memcpy_ms": round(copy, 3),
                                        "fetch_ms": round(fetch, 3), "fetch_vs_round_trip_plus_memcpy": round(fetch / (trip + copy), 2)}
    ray.kill(noop)
    for handle in shards.handles:
        ray.kill(handle)
    return out


# --- as a section of ``python -m benchmarks`` ------------------------------------

SECTION = "scale"
SCALE_CONCURRENCY = 16  # calls in flight per client in the lifecycle rows


def configs() -> tuple[tuple[int, int], ...]:
    """(shards, TP) of each lifecycle row."""
    return ((1, 1), *((n, RECEIVE_COUNT) for n in SHARD_COUNTS))


def steps(plan: Any) -> int:
    return 4


def run(ctx: Any, sizes: tuple[int, ...], registry_name: str) -> None:
    """The figures above, into the run's results, on the stand-in app the run deployed
    (its encoder serves ``sizes``; its Ingress's registry is ``registry_name``); rank
    actors of its own, ended after."""
    plan, namespace = ctx.plan, ctx.cluster["namespace"]
    ranks = [BatchRank.remote(r, sizes) for r in range(RECEIVE_COUNT)]
    try:
        ray.get([rank.pid.remote() for rank in ranks])
        quiet = measure_quiet_fetch(ranks[0], namespace, ctx.token, plan.scale_rounds, sizes)
        ctx.progress.step("scale: quiet fetch")
        many = measure_fetch_many(ranks, namespace, ctx.token, plan.scale_batch, plan.scale_rounds)
        ctx.progress.step("scale: fetch_many")
        rows = measure_shards(ranks, namespace, ctx.token, plan.lifecycles, SCALE_CONCURRENCY)
        ctx.progress.step("scale: shards")
        paths = service_cpu.measure(ranks, registry_name, namespace, ctx.cluster["http_url"], plan.lifecycles,
                                    SCALE_CONCURRENCY)
        ctx.progress.step("scale: HTTP and handle")
    finally:
        for rank in ranks:
            ray.kill(rank)
    _record(ctx.results, plan, sizes, quiet, many, rows)
    service_cpu.record(ctx.results, SECTION, plan.lifecycles, paths)


def _record(results: Any, plan: Any, sizes: tuple[int, ...], quiet: dict, many: dict, rows: dict) -> None:
    from benchmarks.stats import size_label

    for row in rows.values():
        labels = {"shards": row["shards"], "tp": row["tp"]}
        results.add(SECTION, "lifecycles_per_s", row["lifecycles_per_s"], "1/s", labels, n=plan.lifecycles)
        results.add(SECTION, "fetch_errors", row["fetch_errors"], "calls", labels, n=plan.lifecycles * row["tp"])
        for role, ms in row["cpu_ms_per_lifecycle"].items():
            results.add(SECTION, "cpu_s_per_lifecycle", ms / 1e3, "s", {**labels, "process": role}, n=plan.lifecycles)
    labels = {"shards": many["shards"], "batch": many["batch"]}
    batched = results.add(SECTION, "fetch_many_s_per_request", many["fetch_many_ms_per_request"] / 1e3, "s", labels)
    singles = results.add(
        SECTION, "fetch_in_flight_s_per_request", many["fetch_async_in_flight_ms_per_request"] / 1e3, "s", labels
    )
    results.ratio(SECTION, "fetch_many_vs_in_flight", results.value(batched), results.value(singles), [batched, singles],
                  labels, how="median per request: one fetch_many / the same fetch_async calls in flight")
    for nbytes, row in zip(sizes, quiet.values(), strict=True):  # measured in this order
        size = {"size_mb": size_label(nbytes)}
        keys = [results.add(SECTION, f"quiet_{name}_s", row[f"{name}_ms"] / 1e3, "s", size)
                for name in ("fetch", "round_trip", "memcpy")]
        value = results.ratio(
            SECTION, "quiet_fetch_vs_round_trip_plus_memcpy", row["fetch_ms"], row["round_trip_ms"] + row["memcpy_ms"],
            keys, size, how="medians, interleaved round by round on a quiet cluster: fetch / (round trip + memcpy)",
        )
        results.target(SECTION, "quiet_fetch_vs_round_trip_plus_memcpy", value, "<=", 1.5,
                       "quiet fetch <= 1.5 x (one actor round trip + one memcpy), measured interleaved", size, keys)
    results.note(SECTION, (
        f"stand-in encoder; lifecycles of {plan.lifecycles} at {SCALE_CONCURRENCY} calls in flight per client; "
        f"{plan.scale_rounds} interleaved rounds for fetch_many (batches of {plan.scale_batch}) and the quiet fetch."
    ))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lifecycles", type=int, default=400, help="lifecycles per shard count (default 400)")
    parser.add_argument("--concurrency", type=int, default=16, help="calls in flight per client (default 16)")
    parser.add_argument("--batch", type=int, default=32, help="requests per fetch_many (default 32)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds of the interleaved figures (default 30)")
    args = parser.parse_args()
    with standin.served_alone("scale", QUIET_SIZES) as served:
        namespace, token = served["namespace"], served["token"]
        ranks = [BatchRank.remote(r) for r in range(RECEIVE_COUNT)]
        ray.get([rank.pid.remote() for rank in ranks])
        report = {
            "quiet_fetch": measure_quiet_fetch(ranks[0], namespace, token, args.rounds),
            "fetch_many": measure_fetch_many(ranks, namespace, token, args.batch, args.rounds),
            "shards": measure_shards(ranks, namespace, token, args.lifecycles, args.concurrency),
            "paths": service_cpu.measure(ranks, served["registry_name"], namespace, served["http_url"], args.lifecycles,
                                         args.concurrency),
            "settings": vars(args),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
