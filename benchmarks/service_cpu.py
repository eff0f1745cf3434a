"""CPU per request through the service's front doors: part of the ``scale`` section.

A lifecycle here is what a user's request costs end to end: one encode through the
app's real ``Ingress`` (over HTTP, through Serve's proxy, or through the Python
handle), then ``receive_count`` = 4 rank fetches (``EmbeddingReceiver.fetch_async``,
the release inside the last), on the stand-in app the run deployed (one registry
shard, the stand-in encoder with 8 KB items, so no model is measured). The clients
keep ``concurrency`` encodes in flight (``wait: false``: answered once accepted) and
each rank as many fetches.

For each path it reports lifecycles per second and the CPU milliseconds per
lifecycle of every process, by role (``benchmarks.cpu``), and ``service``: all of
them but the load-generating driver, which stands for the clients. The targets
compare ``service`` and the registry's share with what a lifecycle should cost.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from typing import Any, Callable

import httpx
import ray
from ray import serve

from benchmarks import standin
from benchmarks.cpu import CpuMeter, by_title
from benchmarks.probes import pipelined

PATHS = ("http", "handle")
ROLES = ("registry", "ingress", "proxy", "encoder", "ranks", "driver", "controller", "raylet", "gcs", "other", "all", "service")
# What a lifecycle (encode + 4 fetches) should cost, CPU ms summed over the service's processes.
TARGET_MS = {"http": 10.0, "handle": 6.0}
# ... and in the registry alone, on either path.
REGISTRY_TARGET_MS = 2.0


def _body(req_id: str, receive_count: int) -> dict[str, Any]:
    data = base64.b64encode(standin.media(standin.TINY, req_id)).decode()
    return {"req_id": req_id, "receive_count": receive_count, "wait": False, "items": [{"type": "image", "image": data}]}


async def _encode_all(path: str, url: str, bodies: list[dict[str, Any]], concurrency: int, app: str) -> None:
    pending = iter(bodies)
    if path == "handle":
        handle = serve.get_app_handle(app)

        async def one() -> None:
            await handle.encode.remote(next(pending))

        await pipelined(one, len(bodies), concurrency)
        return
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def post() -> None:
            response = await client.post(url, content=json.dumps(next(pending)), headers={"content-type": "application/json"})
            response.raise_for_status()

        await pipelined(post, len(bodies), concurrency)


def timed_lifecycles(
    ranks: list[Any], n: int, concurrency: int, classify: Any, encode: Callable[[list[str]], None]
) -> tuple[float, CpuMeter, int]:
    """``n`` lifecycles: ``encode(req_ids)`` submits them (receive_count = ``len(ranks)``) while
    every rank fetches each; (lifecycles per second, the CPU meter, failed fetches)."""
    req_ids = [uuid.uuid4().hex for _ in range(n)]
    with CpuMeter(classify) as cpu:
        start = time.perf_counter()
        fetching = [rank.fetch_all.remote(req_ids, concurrency) for rank in ranks]
        encode(req_ids)
        failed = sum(ray.get(fetching))
        elapsed = time.perf_counter() - start
    return n / elapsed, cpu, failed


def measure(
    ranks: list[Any], registry_name: str, namespace: str, http_url: str, lifecycles: int, concurrency: int,
    app: str = standin.APP,
) -> dict[str, Any]:
    """Per path: lifecycles/s, failed fetches and CPU ms per lifecycle by role, through the
    stand-in app ``app`` (served under ``/app``)."""
    registry = ray.get_actor(registry_name, namespace=namespace)
    ray.get([rank.use_registry.remote(registry_name, namespace) for rank in ranks])
    classify = by_title(
        {f"ServeReplica:{app}:Encoder": "encoder", f"ServeReplica:{app}:Ingress": "ingress", "ProxyActor": "proxy",
         "ServeController": "controller", "raylet/raylet": "raylet", "gcs_server": "gcs"},
        {ray.get(registry.ping.remote())["pid"]: "registry", **dict.fromkeys(ray.get([r.pid.remote() for r in ranks]), "ranks")},
    )
    url = f"{http_url}/{app}/v1/encode"
    out: dict[str, Any] = {}
    for path in PATHS:
        def encode(req_ids: list[str], path: str = path) -> None:
            asyncio.run(_encode_all(path, url, [_body(req_id, len(ranks)) for req_id in req_ids], concurrency, app))

        timed_lifecycles(ranks, max(20, lifecycles // 10), concurrency, classify, encode)  # warm-up
        rate, cpu, failed = timed_lifecycles(ranks, lifecycles, concurrency, classify, encode)
        ms = {role: cpu.by_role.get(role, 0.0) / lifecycles * 1e3 for role in ROLES if role != "service"}
        ms["service"] = ms["all"] - ms["driver"]
        out[path] = {"tp": len(ranks), "lifecycles_per_s": round(rate, 1), "fetch_errors": failed,
                     "cpu_ms_per_lifecycle": {role: round(value, 2) for role, value in ms.items()}}
    return out


def record(results: Any, section: str, lifecycles: int, rows: dict[str, Any]) -> None:
    for path, row in rows.items():
        labels = {"path": path, "tp": row["tp"]}
        results.add(section, "lifecycles_per_s", row["lifecycles_per_s"], "1/s", labels, n=lifecycles)
        results.add(section, "fetch_errors", row["fetch_errors"], "calls", labels, n=lifecycles * labels["tp"])
        keys = {}
        for role, ms in row["cpu_ms_per_lifecycle"].items():
            keys[role] = results.add(section, "cpu_s_per_lifecycle", ms / 1e3, "s", {**labels, "process": role}, n=lifecycles)
        results.target(section, "cpu_s_per_lifecycle", row["cpu_ms_per_lifecycle"]["service"] / 1e3, "<=",
                       TARGET_MS[path] / 1e3, f"CPU per lifecycle (encode + 4 fetches) over the service's processes <= "
                       f"{TARGET_MS[path]:.0f} ms", {**labels, "process": "service"}, [keys["service"]])
        results.target(section, "cpu_s_per_lifecycle", row["cpu_ms_per_lifecycle"]["registry"] / 1e3, "<=",
                       REGISTRY_TARGET_MS / 1e3, f"the registry's share of it <= {REGISTRY_TARGET_MS:.0f} ms",
                       {**labels, "process": "registry"}, [keys["registry"]])
