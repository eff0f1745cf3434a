"""The registry under load: the one lifecycle harness (``Lifecycles``) and the ``registry``, ``scale``
and ``ingress`` sections built on it.

A lifecycle is what one request costs the service: its submit with ``wait: false``, straight
to its registry shard or as an encode through the stand-in app's Ingress (HTTP or handle),
then ``tp`` rank fetches, the last releasing it. ``count`` run at once, driver and ranks each
keeping ``concurrency`` calls in flight (an early fetch waits in the registry, as a real
rank's would); the stand-in encoder's 8 KB items cost nothing, so the service's machinery is
measured, not a model. Per lifecycle it also reads the CPU of every process by role, the
calls the registry executed (from the raylets, so counting adds none), and the items per
Encoder call and requests per submit call (what batching achieved).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import statistics
import time
import uuid
from typing import Any

import httpx
import ray
from ray import serve

from benchmarks import standin
from benchmarks.cluster import CpuMeter, executed_tasks
from benchmarks.decoder_side import pipelined
from benchmarks.runner import RECEIVE_COUNT, Context
from registry import get_or_create_shards, lookup_shards, media_input

_COUNTERS = ("encoder_calls_total", "encoder_call_items_total", "submit_calls_total", "submitted_requests_total")
SCALE_ROWS = ((1, 1), (1, RECEIVE_COUNT), (2, RECEIVE_COUNT), (4, RECEIVE_COUNT))  # (shards, TP)
SCALE_CONCURRENCY = 16  # calls in flight per client in the scale rows
PATHS = ("http", "handle")
TARGET_MS = {"http": 10.0, "handle": 6.0}  # CPU per lifecycle over the service's processes
REGISTRY_TARGET_MS = 2.0  # ... and in the registry alone, on either path


@dataclasses.dataclass
class Measured:
    """One timed batch of lifecycles; everything but the rate and the failures is per lifecycle."""

    rate: float
    cpu_s: dict[str, float]  # by role, and "service" = all but the driver
    registry_calls: float
    failed: int  # fetches that raised
    items_per_encoder_call: float
    requests_per_submit_call: float


class Lifecycles:
    """Lifecycles against the registry ``shards`` (``registry.Shards``), entering at ``entry``:
    ``registry``, or ``http`` or ``handle`` of the stand-in app ``app`` whose Ingress uses those
    shards (served at ``{http_url}/{app}``). The first ``run`` is preceded by an untimed warm-up."""

    def __init__(self, ranks: list[Any], shards: Any, entry: str = "registry", http_url: str = "", app: str = standin.APP):
        self.ranks, self.shards, self.entry, self.app = ranks, shards, entry, app
        self._url = f"{http_url}/{app}/v1/encode"
        registry_pids = [ping["pid"] for ping in ray.get([h.ping.remote() for h in shards.handles])]
        self._roles = {f"ServeReplica:{app}:Encoder": "encoder", f"ServeReplica:{app}:Ingress": "ingress"}
        self._pids = {**dict.fromkeys(registry_pids, "registry"), **dict.fromkeys(ray.get([r.pid.remote() for r in ranks]), "ranks")}
        self._warm = False

    def run(self, count: int, concurrency: int, tp: int) -> Measured:
        if not self._warm:
            self._timed(max(20, count // 10), concurrency, tp)
            self._warm = True
        return self._timed(count, concurrency, tp)

    def _counters(self) -> list[int]:
        stats = ray.get([h.stats.remote() for h in self.shards.handles])
        return [sum(s.get(key, 0) for s in stats) for key in _COUNTERS]

    def _timed(self, count: int, concurrency: int, tp: int) -> Measured:
        fetchers = self.ranks[:tp]
        ray.get([rank.use_registry.remote(self.shards.name, self.shards.namespace) for rank in fetchers])
        req_ids = [uuid.uuid4().hex for _ in range(count)]
        counters, calls = self._counters(), executed_tasks(self.shards.handles)
        with CpuMeter(self._roles, self._pids) as cpu:
            start = time.perf_counter()
            fetching = [rank.fetch_all.remote(req_ids, concurrency) for rank in fetchers]
            self.submit(req_ids, concurrency, tp)
            failed = sum(ray.get(fetching))
            rate = count / (time.perf_counter() - start)
        calls = executed_tasks(self.shards.handles) - calls
        encoder_calls, items, submits, requests = (a - b for a, b in zip(self._counters(), counters, strict=True))
        cpu_s = {role: seconds / count for role, seconds in cpu.by_role.items()}
        cpu_s["service"] = cpu_s.get("all", 0.0) - cpu_s.get("driver", 0.0)
        return Measured(rate, cpu_s, calls / count, failed, items / max(encoder_calls, 1), requests / max(submits, 1))

    def submit(self, req_ids: list[str], concurrency: int, tp: int) -> None:
        """Submit ``req_ids`` (``receive_count`` = ``tp``) at ``entry``, ``concurrency`` at a time."""
        asyncio.run(self._submit_all(req_ids, concurrency, tp))

    async def _submit_all(self, req_ids: list[str], concurrency: int, tp: int) -> None:
        pending = iter(req_ids)
        if self.entry == "registry":
            async def submit() -> None:
                req_id = next(pending)
                item = media_input(standin.media(standin.TINY, req_id))
                await self.shards.of(req_id).submit.remote(req_id, [item], req_id, tp, False)

            await pipelined(submit, len(req_ids), concurrency)
            return

        def body(req_id: str) -> dict[str, Any]:
            image = base64.b64encode(standin.media(standin.TINY, req_id)).decode()
            return {"req_id": req_id, "receive_count": tp, "wait": False, "items": [{"type": "image", "image": image}]}

        if self.entry == "handle":
            handle = serve.get_app_handle(self.app)
            await pipelined(lambda: handle.encode.remote(body(next(pending))), len(req_ids), concurrency)
            return
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
            async def post() -> None:
                content = json.dumps(body(next(pending)))
                response = await client.post(self._url, content=content, headers={"content-type": "application/json"})
                response.raise_for_status()

            await pipelined(post, len(req_ids), concurrency)


def _record_cpu(ctx: Context, section: str, cpu_s: dict[str, float], **labels: Any) -> None:
    for role, seconds in cpu_s.items():
        ctx.results.add(section, "cpu_s_per_lifecycle", seconds, process=role, **labels)


def run_registry(ctx: Context) -> None:
    plan, results, section = ctx.plan, ctx.results, "registry"
    harness = Lifecycles(ctx.ranks, lookup_shards(ctx.app.registry_name, ctx.namespace))
    peer, ping = {ray.get(ctx.peer.pid.remote()): "peer"}, ctx.peer.ping.remote
    asyncio.run(pipelined(ping, 200, 16))  # warm-up: connections, workers, code paths
    top, calls, failed = max(plan.registry_concurrency), [], 0
    for concurrency in plan.registry_concurrency:
        with CpuMeter({}, peer) as raw_cpu:
            rate = asyncio.run(pipelined(ping, plan.raw_calls, concurrency))
        raw = results.add(section, "raw_calls_per_s", rate, "1/s", n=plan.raw_calls, concurrency=concurrency)
        measured = harness.run(plan.lifecycles, concurrency, RECEIVE_COUNT)
        life = results.add(section, "lifecycles_per_s", measured.rate, "1/s", n=plan.lifecycles, concurrency=concurrency)
        calls.append(measured.registry_calls)
        failed += measured.failed
        if concurrency == top:  # where the CPU went, at the concurrency the target is judged at
            raw_top, life_top = raw, life
            for role in ("peer", "driver"):
                results.add(section, "cpu_s_per_raw_call", raw_cpu.by_role.get(role, 0.0) / plan.raw_calls,
                            concurrency=top, process=role)
            _record_cpu(ctx, section, measured.cpu_s, concurrency=top)
        ctx.step(f"registry: {concurrency} in flight")
    per = results.add(section, "registry_calls_per_lifecycle", max(calls), "calls")
    results.add(section, "fetch_errors", failed, "calls")
    serve_rate = ray.get(ctx.peer.serve_calls_per_s.remote(standin.APP, "Encoder", plan.raw_calls, top))
    serve_rate = results.add(section, "serve_calls_per_s", serve_rate, "1/s", concurrency=top)
    value = results.ratio(section, "lifecycles_vs_raw_per_call", life_top * per, raw_top, concurrency=top)
    results.ratio(section, "lifecycles_vs_raw_with_serve_call", life_top * (per / raw_top + 1 / serve_rate), 1.0,
                  concurrency=top)
    results.target(section, "lifecycles_vs_raw_per_call", value, ">=", 0.8,
                   "lifecycles/s >= 80% of (raw no-op calls/s / registry calls per lifecycle)", concurrency=top)
    results.target(section, "registry_calls_per_lifecycle", per, "<=", RECEIVE_COUNT + 1,
                   f"the minimum: 1 submit + {RECEIVE_COUNT} fetches, the release inside the last (no polling)")


def _registry(ctx: Context, base: str, shards: int) -> Any:
    """A registry of its own, ``shards`` shards, whose encoder is the stand-in app's."""
    from deployments import AppConfig

    config = AppConfig(registry_name=ctx.name(base), registry_namespace=ctx.namespace, registry_shards=shards,
                       cache_max_bytes=0, model={"family": "tiny-vit", "dtype": "bfloat16"})
    return get_or_create_shards(config.registry_settings(standin.APP))


def run_scale(ctx: Context) -> None:
    plan, results, section = ctx.plan, ctx.results, "scale"
    # One registry per shard count, used by every row with that count and then by fetch_many:
    # each row ends with its entries released, and a shard's start costs more than a row here.
    registries = {count: _registry(ctx, f"scale_{count}", count) for count in sorted({count for count, _ in SCALE_ROWS})}
    for count, tp in SCALE_ROWS:
        measured = Lifecycles(ctx.ranks, registries[count]).run(plan.lifecycles, SCALE_CONCURRENCY, tp)
        results.add(section, "lifecycles_per_s", measured.rate, "1/s", n=plan.lifecycles, shards=count, tp=tp)
        results.add(section, "fetch_errors", measured.failed, "calls", shards=count, tp=tp)
        _record_cpu(ctx, section, measured.cpu_s, shards=count, tp=tp)
        ctx.step(f"scale: {count} shards, TP {tp}")
    shards = registries[max(registries)]
    harness, pair = Lifecycles(ctx.ranks, shards), ctx.ranks[:2]
    ray.get([rank.use_registry.remote(shards.name, shards.namespace) for rank in pair])
    many, in_flight = [], []
    for r in range(plan.scale_rounds + 1):
        req_ids = [uuid.uuid4().hex for _ in range(plan.scale_batch)]
        harness.submit(req_ids, plan.scale_batch, 2)
        ray.get([shards.of(req_id).describe.remote(req_id, 60.0) for req_id in req_ids])  # staged: no fetch waits
        first, second = pair if r % 2 else pair[::-1]
        t_many = ray.get(first.fetch_batch.remote(req_ids, True))  # one after the other: each has the machine
        t_in_flight = ray.get(second.fetch_batch.remote(req_ids, False))
        if r:  # round 0 warms both up
            many.append(t_many / plan.scale_batch)
            in_flight.append(t_in_flight / plan.scale_batch)
    for handle in (handle for registry in registries.values() for handle in registry.handles):
        ray.kill(handle)
    labels = {"shards": len(shards.handles), "batch": plan.scale_batch}
    batched = results.add(section, "fetch_many_s_per_request", samples=many, **labels)
    singles = results.add(section, "fetch_in_flight_s_per_request", samples=in_flight, **labels)
    results.ratio(section, "fetch_many_vs_in_flight", batched, singles, **labels)


def run_ingress(ctx: Context) -> None:
    plan, results, section = ctx.plan, ctx.results, "ingress"
    harnesses = {}
    for variant in standin.VARIANTS:
        shards = lookup_shards(ctx.name(f"bench_{variant}_registry"), ctx.namespace)
        for path in PATHS:
            harnesses[variant, path] = Lifecycles(ctx.ranks, shards, path, ctx.http_url, standin.app_name(variant))
    runs: dict[tuple[str, str, int], list[Measured]] = {}
    for r in range(plan.ingress_rounds):
        for concurrency in plan.ingress_concurrency:
            for key in (list(harnesses) if r % 2 == 0 else list(harnesses)[::-1]):
                measured = harnesses[key].run(plan.ingress_lifecycles, concurrency, RECEIVE_COUNT)
                runs.setdefault((*key, concurrency), []).append(measured)
        ctx.step(f"ingress: round {r + 1}")
    cpu: dict[tuple[str, str, int], dict[str, float]] = {}
    for (variant, path, concurrency), measured in runs.items():
        labels = {"variant": variant, "path": path, "concurrency": concurrency}
        for name, unit in (("rate", "1/s"), ("items_per_encoder_call", "items"), ("requests_per_submit_call", "requests")):
            value = statistics.median(getattr(m, name) for m in measured)
            results.add(section, "lifecycles_per_s" if name == "rate" else name, value, unit, **labels)
        results.add(section, "fetch_errors", sum(m.failed for m in measured), "calls", **labels)
        roles = {role for m in measured for role in m.cpu_s}
        cpu[variant, path, concurrency] = {role: statistics.median(m.cpu_s.get(role, 0.0) for m in measured)
                                           for role in sorted(roles)}
        _record_cpu(ctx, section, cpu[variant, path, concurrency], **labels)
    for path in PATHS:
        for concurrency in plan.ingress_concurrency:
            batched, single = cpu["batched", path, concurrency], cpu["single", path, concurrency]
            for role in ("service", "registry", "ingress", "encoder"):
                results.ratio(section, "batched_vs_single_cpu", batched[role], single[role], path=path,
                              concurrency=concurrency, process=role)
        judged, labels = cpu["batched", path, plan.ingress_concurrency[0]], {"path": path, "variant": "batched"}
        results.target(section, "cpu_s_per_lifecycle", judged["service"], "<=", TARGET_MS[path] / 1e3,
                       f"CPU per lifecycle (encode + 4 fetches) over the service's processes <= {TARGET_MS[path]:.0f} ms",
                       concurrency=plan.ingress_concurrency[0], process="service", **labels)
        results.target(section, "cpu_s_per_lifecycle", judged["registry"], "<=", REGISTRY_TARGET_MS / 1e3,
                       f"the registry's share of it <= {REGISTRY_TARGET_MS:.0f} ms",
                       concurrency=plan.ingress_concurrency[0], process="registry", **labels)
