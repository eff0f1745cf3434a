"""The ``e2e`` section: images per second through HTTP and the Python handle, against the model in one process.

Two towers of the ``tiny-vit`` family, bf16, 224 x 224 PNGs: ``tiny`` (2 layers, a nearly
free forward: its ratio is the pure serving overhead) and ``vit_b`` (ViT-B/16-sized, about
86 M parameters, seeded). Each is served as the real app, one Encoder replica with
``num_cpus=2`` (two intra-op threads); closed-loop clients keep ``concurrency`` requests in
flight, and the requests completed in a window after a warm-up give images/s and latencies.
Every image's bytes are distinct (a ``tEXt`` nonce), so no encode is shared. The baseline is
the batched forward in the driver with the replica's threads while the cluster idles,
before and after the served runs (``best`` of the two is what the ratios use).
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
import struct
import time
import zlib
from typing import Any, Awaitable, Callable

import httpx
import numpy as np
import ray
import torch
from PIL import Image
from ray import serve

from benchmarks.cluster import CpuMeter
from benchmarks.runner import Context

SECTION = "e2e"
SIDE = 224
MODELS: dict[str, dict[str, Any]] = {  # served in the plan's e2e_dtype
    "tiny": {"family": "tiny-vit"},
    "vit_b": {"family": "tiny-vit",
              "options": {"hidden_size": 768, "depth": 12, "num_heads": 12, "out_size": 768, "max_pixels": SIDE * SIDE}},
}
PATHS = ("handle", "http")
# A window closes only once this many requests per request in flight completed inside it, so a
# slow machine measures a lower rate instead of failing; the longest it may then last.
_MIN_SAMPLES_PER_SLOT = 2
_LONGEST_WINDOW_S = 300.0


def request_pool(count: int, seed: int, bases: int = 8) -> list[dict]:
    """``count`` encode bodies of one image each, all with distinct bytes: ``bases`` random PNGs
    (incompressible), each copy with a ``tEXt`` chunk of its own after the 33-byte header."""
    images = []
    for i in range(bases):
        out = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed + i).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(out, "PNG")
        images.append(out.getvalue())
    chunks = [b"tEXtnonce\x00" + str(i).encode() for i in range(count)]
    chunks = [struct.pack(">I", len(c) - 4) + c + struct.pack(">I", zlib.crc32(c)) for c in chunks]
    return [{"receive_count": 1, "items": [{"type": "image", "image": base64.b64encode(
        images[i % bases][:33] + chunk + images[i % bases][33:]).decode()}]} for i, chunk in enumerate(chunks)]


async def _closed_loop(
    send: Callable[[Any], Awaitable], bodies: list, concurrency: int, warmup_s: float, window_s: float
) -> tuple[list[float], int, float]:
    """Keep ``concurrency`` requests in flight; the latencies of those completed inside the window,
    the requests completed in all, and the window's seconds. The window lasts ``window_s``, or
    until ``_MIN_SAMPLES_PER_SLOT`` x ``concurrency`` completed in it (up to ``_LONGEST_WINDOW_S``):
    the rate is what completed over how long it really lasted. A completion inside counts
    whenever its request started; no request starts after the window."""
    counter = itertools.count()
    opens = time.perf_counter() + warmup_s
    earliest_close, latest_close = opens + window_s, opens + max(window_s, _LONGEST_WINDOW_S)
    wanted = _MIN_SAMPLES_PER_SLOT * concurrency
    latencies: list[float] = []
    closed_at: float | None = None
    issued = 0

    async def worker() -> None:
        nonlocal issued, closed_at
        while closed_at is None and time.perf_counter() < latest_close:
            issued += 1
            body = bodies[next(counter) % len(bodies)]
            sent = time.perf_counter()
            await send(body)
            done = time.perf_counter()
            if closed_at is not None or done < opens:
                continue
            if done > latest_close:
                closed_at = latest_close
                continue
            latencies.append(done - sent)
            if done >= earliest_close and len(latencies) >= wanted:
                closed_at = done

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, issued, (closed_at if closed_at is not None else latest_close) - opens


def _inprocess(encoder: Any, prepared: list[Any], threads: int, batch: int, seconds: float) -> float:
    """Images/s of the model's batched forward in this process, on ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        encoder.encode_batch(prepared[:batch])  # the first pass allocates; later ones need not
        images, spent, chunks = 0, 0.0, itertools.count()
        while spent < seconds:
            first = next(chunks) * batch % len(prepared)
            start = time.perf_counter()
            encoder.encode_batch(prepared[first:first + batch])
            spent += time.perf_counter() - start
            images += len(prepared[first:first + batch])
    finally:
        torch.set_num_threads(before)
    return images / spent


def app_name(model: str) -> str:
    return f"bench-{model.replace('_', '')}"


def registry_name(ctx: Context, model: str) -> str:
    return ctx.name(f"bench_{model}_registry")


def application(ctx: Context, model: str) -> Any:
    """The real app serving ``model`` (deploy it under ``app_name(model)``, route ``/<app name>``)."""
    from deployments import compose_app

    args = {"registry_name": registry_name(ctx, model), "registry_namespace": ctx.namespace, "cache_max_bytes": 0,
            "ttl_s": 4.0, "default_receive_count": 1, "model": {**MODELS[model], "dtype": ctx.plan.e2e_dtype}}
    options = {"Encoder": {"ray_actor_options": {"num_cpus": 2}}, "Ingress": {"ray_actor_options": {"num_cpus": 0}}}
    return compose_app(args, deployment_options=options)


def run(ctx: Context) -> None:
    for seed, model in enumerate(MODELS):
        try:
            _run_model(ctx, model, 100 * (seed + 1))
        finally:  # an idle app still costs CPU that the next model would miss
            ray.kill(ray.get_actor(registry_name(ctx, model), namespace=ctx.namespace))
            serve.delete(app_name(model), _blocking=ctx.plan.blocking_cleanup)


def _run_model(ctx: Context, model: str, seed: int) -> None:
    from deployments import BatchConfig
    from encoder import EncoderSpec, build_encoder

    plan, results, app = ctx.plan, ctx.results, app_name(model)
    registry = ray.get_actor(registry_name(ctx, model), namespace=ctx.namespace)
    pool = request_pool(plan.image_pool, seed)
    threads = int(serve.get_deployment_handle("Encoder", app).ready.remote().result()["torch_threads"])
    # The largest batch the served runs can form: no larger in-process batch is a fair bar.
    batch = min(BatchConfig().max_batch_size, max(plan.e2e_concurrency))
    encoder = build_encoder(EncoderSpec(**MODELS[model], dtype=plan.e2e_dtype))
    prepared = [encoder.prepare(base64.b64decode(body["items"][0]["image"])) for body in pool[:8 * batch]]
    results.add(SECTION, "model_parameters", sum(p.numel() for p in encoder.model.parameters()), "parameters", model=model)
    baseline = {"before": _inprocess(encoder, prepared, threads, batch, plan.inprocess_s)}
    joined = ray.get(registry.stats.remote())["encodes_joined_total"]
    roles = ({f"ServeReplica:{app}:Encoder": "encoder", f"ServeReplica:{app}:Ingress": "ingress"},
             {ray.get(registry.ping.remote())["pid"]: "registry"})
    saturated = asyncio.run(_served(ctx, model, pool, roles))
    joined = ray.get(registry.stats.remote())["encodes_joined_total"] - joined
    baseline["after"] = _inprocess(encoder, prepared, threads, batch, plan.inprocess_s)
    baseline["best"] = max(baseline.values())
    for when, rate in baseline.items():
        results.add(SECTION, "inprocess_forward_images_per_s", rate, "images/s", model=model, when=when)
    for path, rate in saturated.items():
        value = results.ratio(SECTION, "served_vs_inprocess", rate, baseline["best"], model=model, path=path)
        if model == "vit_b":
            results.target(SECTION, "served_vs_inprocess", value, ">=", 0.9,
                           "ViT-B-sized tower: served images/s at saturation >= 0.9 x in-process batched forward",
                           model=model, path=path)
    results.note(SECTION, f"{model}: replica torch threads {threads}, in-process batch {batch}; encodes shared "
                          f"between requests during the served runs: {joined} (0: every image was encoded).")
    ctx.step(f"e2e: {model}")


async def _served(ctx: Context, model: str, pool: list[dict], roles: tuple[dict, dict]) -> dict[str, float]:
    """Every path at every concurrency; the saturated (best) images/s per path."""
    plan, results, app = ctx.plan, ctx.results, app_name(model)
    handle, url = serve.get_app_handle(app), f"{ctx.http_url}/{app}/v1/encode"
    raw = [json.dumps(body).encode() for body in pool]  # serialized once: the client should not spend its time on JSON
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=max(plan.e2e_concurrency) + 4)) as client:

        async def via_handle(body: dict) -> None:
            if (out := await handle.encode.remote(body))["state"] != "staged":
                raise RuntimeError(f"unexpected state {out['state']}")

        async def via_http(body: bytes) -> None:
            response = await client.post(url, content=body, headers={"content-type": "application/json"})
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")

        senders = {"handle": (via_handle, pool), "http": (via_http, raw)}
        # Both paths warm at once (first batches, connections) before anything is timed, each
        # with images of its own so that no encode is shared.
        n = plan.e2e_warmup_images
        await asyncio.gather(*(send(b) for i, (send, bodies) in enumerate(senders.values()) for b in bodies[i * n:(i + 1) * n]))
        saturated = {}
        for path, (send, bodies) in senders.items():
            rates = []
            for concurrency in plan.e2e_concurrency:
                labels = {"model": model, "path": path, "concurrency": concurrency}
                with CpuMeter(*roles) as cpu:
                    latencies, total, window_s = await _closed_loop(send, bodies, concurrency, plan.e2e_warmup_s,
                                                                    plan.e2e_window_s)
                if not latencies:
                    raise RuntimeError(f"no {path} request completed within {window_s:.0f} s at concurrency {concurrency}")
                rates.append(results.add(SECTION, "images_per_s", len(latencies) / window_s, "images/s",
                                         n=len(latencies), **labels))
                results.add(SECTION, "latency_s", samples=latencies, **labels)
            for role, seconds in cpu.by_role.items():  # where the CPU went, at the last (highest) concurrency
                results.add(SECTION, "cpu_s_per_image", seconds / total, n=total, model=model, path=path, process=role)
            saturated[path] = results.add(SECTION, "saturated_images_per_s", max(rates), "images/s", model=model, path=path)
    return saturated
