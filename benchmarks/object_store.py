"""The object store's two sections: ``staging`` (what writing an embedding costs per MB) and
``memory`` (how many store bytes a burst holds per staged byte).

``staging``: the stand-in app's registry calls the stand-in encoder (the real ``Encoder``
code, a free forward pass) and the driver times ``submit(wait=True)``. Each round submits an
8 KB item, which travels inline and touches no store, then every size in a new order;
``staging_extra_s`` is a submit less that round's inline one (the pair shares the moment's
load). Beside it, in the replica's process: ``ray.put`` and a warm memcpy of the same payload.
Per MB is the slope of a least-squares line through the sizes' p50s, so fixed costs drop out.

``memory``: per path, ``memory_burst`` requests go through the real Ingress at once, through
the handle (each image stored by the caller, sent as an ``image_ref`` item) and over HTTP
(base64; the Ingress stores each item once). The stand-in encoder stages 4.72 MB per request;
each input is as large as a 384 x 384 RGB image's pixels (0.44 MB, what a random PNG of it
weighs). A thread samples the raylet's ``object_store_bytes_used`` every few milliseconds;
then two ranks fetch every request (the second releases it) and the store is watched until
it is back to its level before the burst (within 1 MiB).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import json
import random
import threading
import time
from typing import Iterator

import httpx
import numpy as np
import ray
from ray import serve

from benchmarks import standin
from benchmarks.cluster import object_store_usage
from benchmarks.report import size_label
from benchmarks.runner import SIZES, Context

# The fetch sizes plus 75.5 MB (9216 tokens x 4096): a long lever for the per-MB slope,
# whose small sizes sit within the noise of a call that itself takes milliseconds.
STAGING_SIZES = (*SIZES, 9216 * 8192)
_KINDS = ("submit", "staging_extra", "put", "memcpy")


def run_staging(ctx: Context) -> None:
    plan, results, app = ctx.plan, ctx.results, ctx.app
    for _ in range(3):  # warm-up of the call path; inline items touch no store pages
        app.cancel(app.submit(standin.TINY, receive_count=1)[0])
    inline: list[float] = []
    samples: dict[str, dict[int, list[float]]] = {kind: {n: [] for n in STAGING_SIZES} for kind in _KINDS}
    order = random.Random(0)
    for _ in range(plan.staging_rounds + 1):  # round 0 warms every size up; its samples are dropped
        inline_id, inline_s = app.submit(standin.TINY, receive_count=1)
        app.cancel(inline_id)
        inline.append(inline_s)
        for nbytes in order.sample(STAGING_SIZES, len(STAGING_SIZES)):
            req_id, seconds = app.submit(nbytes, receive_count=1)
            app.cancel(req_id)
            measured = (seconds, seconds - inline_s, app.encoder.put.remote(nbytes).result(),
                        app.encoder.memcpy.remote(nbytes).result())
            for kind, value in zip(_KINDS, measured, strict=True):
                samples[kind][nbytes].append(value)
    ctx.step("staging: rounds done")
    results.add("staging", "submit_s", samples=inline[1:], size_mb=size_label(standin.TINY))
    p50 = {kind: [results.add("staging", f"{kind}_s", samples=samples[kind][n][1:], size_mb=size_label(n))
                  for n in STAGING_SIZES] for kind in _KINDS}
    mb = [n / 1e6 for n in STAGING_SIZES]
    slope = {name: results.add("staging", f"{name}_s_per_mb", float(np.polyfit(mb, p50[kind], 1)[0]), "s/MB")
             for kind, name in (("staging_extra", "staging"), ("put", "put"), ("memcpy", "memcpy"))}
    ratio = results.ratio("staging", "staging_per_mb_vs_put", slope["staging"], slope["put"])
    results.ratio("staging", "staging_per_mb_vs_memcpy", slope["staging"], slope["memcpy"])
    results.target("staging", "staging_per_mb_vs_put", ratio, "<=", 1.2,
                   "staging costs no more than one copy per MB: <= 1.2 x ray.put of the same bytes")
    copies = app.encoder.copies_before_store.remote(SIZES[1]).result()
    results.target("staging", "copies_before_store", float(copies), "==", 0.0,
                   "building the staged item from the output tensor copies nothing (the store write is the one copy)")


PATHS = ("handle", "http")
INPUT_BYTES = 384 * 384 * 3
_TOLERANCE = 1024 * 1024
_RETURN_TIMEOUT_S = 30.0


@contextlib.contextmanager
def _peak() -> Iterator[list[int]]:
    """Samples the store's bytes in a thread every few ms while the block runs; yields [the peak]."""
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            peak[0] = max(peak[0], object_store_usage()[0])

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], object_store_usage()[0])


def _settled(timeout_s: float = 15.0) -> int:
    """The store's bytes once two readings 1.2 s apart agree within the tolerance: frees of
    earlier objects reach the raylet asynchronously (in batches, about every second), and a
    baseline taken mid-free would be too high. Smaller changes are Ray's and Serve's own small
    objects, which come and go whatever the sections do."""
    deadline, last = time.perf_counter() + timeout_s, object_store_usage()[0]
    while time.perf_counter() < deadline:
        time.sleep(1.2)
        now = object_store_usage()[0]
        if abs(now - last) <= _TOLERANCE:
            return now
        last = now
    return last


def _body(item: dict) -> dict:
    return {"receive_count": 2, "items": [item]}


def _burst(ctx: Context, path: str, media: list[bytes], baseline: int) -> dict[str, float]:
    """One burst through ``path``: the store's peak above ``baseline``, what was staged, the return.
    Through the handle the caller stores each image as the burst starts, so its copy counts."""
    url = f"{ctx.http_url}/{standin.APP}/v1/encode"
    raw = [json.dumps(_body({"type": "image", "image": base64.b64encode(data).decode()})).encode() for data in media]

    async def burst() -> list[dict]:
        if path == "handle":
            handle = serve.get_app_handle(standin.APP)
            bodies = [_body({"type": "image_ref", "image_ref": ray.put(data)}) for data in media]
            return await asyncio.gather(*(handle.encode.remote(body) for body in bodies))
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=len(raw))) as client:
            async def post(body: bytes) -> dict:
                response = await client.post(url, content=body, headers={"content-type": "application/json"})
                return response.raise_for_status().json()

            return await asyncio.gather(*(post(body) for body in raw))

    with _peak() as peak:
        staged = asyncio.run(burst())
        staged_bytes = sum(item["nbytes"] for out in staged for item in out["items"])
        ray.get([rank.fetch.remote(out["req_id"]) for out in staged for rank in ctx.ranks[:2]])
    del staged
    start = time.perf_counter()
    while (left := object_store_usage()[0] - baseline) > _TOLERANCE and time.perf_counter() - start < _RETURN_TIMEOUT_S:
        time.sleep(0.05)
    return {"peak": peak[0] - baseline, "staged": staged_bytes, "back_s": time.perf_counter() - start, "left": left}


def run_memory(ctx: Context) -> None:
    results, burst = ctx.results, ctx.plan.memory_burst
    ray.get([rank.use_registry.remote(ctx.app.registry_name, ctx.namespace) for rank in ctx.ranks[:2]])
    media = []
    for i in range(2 * burst):  # the stand-in's header, padded to the input's size
        header = standin.media(SIZES[1], f"mem{i}") + b":"
        media.append(header + bytes(INPUT_BYTES - len(header)))
    # Warm-up of the Ingress's handles and threads, with an item small enough to travel inline:
    # nothing of it is in the store, so the baseline need not wait for its free.
    tiny = base64.b64encode(standin.media(standin.TINY, "mem-warm")).decode()
    warm = serve.get_app_handle(standin.APP).encode.remote(_body({"type": "image", "image": tiny})).result()
    ray.get([rank.fetch.remote(warm["req_id"]) for rank in ctx.ranks[:2]])
    results.add("memory", "input_bytes_per_request", INPUT_BYTES, "B")
    gc.collect()
    baseline = _settled()
    for i, path in enumerate(PATHS):
        m = _burst(ctx, path, media[i * burst:(i + 1) * burst], baseline)
        results.add("memory", "staged_bytes", m["staged"], "B", n=burst, path=path)
        results.add("memory", "peak_store_bytes_above_baseline", m["peak"], "B", path=path)
        results.add("memory", "return_to_baseline_s", m["back_s"], path=path)
        results.add("memory", "bytes_left_after_release", m["left"], "B", path=path)
        ratio = results.ratio("memory", "peak_per_staged_byte", m["peak"], m["staged"], path=path)
        # What the peak holds beyond the embeddings, in copies of the burst's inputs.
        results.ratio("memory", "extra_peak_per_input_byte", m["peak"] - m["staged"], burst * INPUT_BYTES, path=path)
        results.target("memory", "peak_per_staged_byte", ratio, "<=", 1.1,
                       "peak object-store bytes per staged byte during a burst <= 1.1", path=path)
        results.target("memory", "returns_to_baseline", float(m["left"] <= _TOLERANCE), "==", 1.0,
                       "object store back to its pre-burst level (within 1 MiB) after every rank fetched and let go",
                       path=path)
        ctx.step(f"memory: burst via {path}")
        if m["left"] > _TOLERANCE:  # not back: the next burst needs a baseline of its own
            baseline = _settled()
