"""5. Memory: peak object-store bytes per staged byte during a burst, and the return to baseline.

The burst goes through the whole app as a client sends it, once through the
Python handle of the real ``Ingress`` (each image stored by the caller and sent
as an ``image_ref`` item, which the Ingress passes on unread) and once over HTTP
(base64 in the body; the Ingress stores each item's bytes once,
``registry.server.inputs``). The registry passes the ref to the ``Encoder`` and keeps
the result. The encoder is the
stand-in (``benchmarks.standin``: the real ``Encoder`` code with a free model),
so every embedding is exactly 4.72 MB (576 tokens x 4096, bfloat16: what a
672 x 672 image gives a Qwen2.5-VL-7B-class model). The media item of each
request is as large as a 384 x 384 random PNG (0.44 MB: incompressible pixels,
a pessimistic input), so the input bytes travel through the object store as a
real image's would; the model's decoding of them touches no object store and is
left out.

Per path, ``plan.memory_burst`` requests (``receive_count`` = 2) are sent at
once while a thread samples the raylet's ``object_store_bytes_used`` every few
milliseconds. Then two rank processes fetch every request (the second fetch
releases it) and drop the tensors, and the store is watched until it is back to
its level before the burst.

Figures, per path: the peak above baseline divided by the bytes staged (the
embeddings' own size; input bytes in flight count against it), the copies of
the input at the peak, the time to return, and the bytes left over. Target:
<= 1.1 store bytes per staged byte, and back to baseline (within 1 MiB, less
than any one embedding).
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import threading
import time

import httpx
import ray
from ray import serve

from benchmarks import standin
from benchmarks.ray_internals import object_store_usage
from benchmarks.images import png
from benchmarks.plan import SIZES, Context, Plan

SECTION = "memory"
EMBEDDING_BYTES = SIZES[1]
INPUT_SIDE = 384
_RETURN_TOLERANCE = 1024 * 1024
_RETURN_TIMEOUT_S = 30.0
PATHS = ("handle", "http")


def steps(plan: Plan) -> int:
    return 1 + len(PATHS)


class _Sampler:
    """Samples object-store bytes in a thread until stopped; keeps the peak."""

    def __init__(self) -> None:
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, object_store_usage()[0])
            self.samples += 1
            self._stop.wait(0.002)

    def __enter__(self) -> "_Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, object_store_usage()[0])


def _settled(timeout_s: float = 15.0) -> int:
    """The store's bytes once two readings 1.2 s apart agree within the return tolerance:
    frees of earlier objects reach the raylet asynchronously (in batches, about every
    second), and a baseline taken mid-free would be too high. Smaller changes are Ray's
    and Serve's own small objects, which come and go whatever the sections do."""
    deadline = time.perf_counter() + timeout_s
    last = object_store_usage()[0]
    while time.perf_counter() < deadline:
        time.sleep(1.2)
        now = object_store_usage()[0]
        if abs(now - last) <= _RETURN_TOLERANCE:
            return now
        last = now
    return last


def _media(count: int) -> list[bytes]:
    """Media that carry the stand-in header, padded to a real image's size."""
    input_bytes = len(png(INPUT_SIDE, seed=0))
    out = []
    for i in range(count):
        header = standin.media(EMBEDDING_BYTES, f"mem{i}") + b":"
        out.append(header + bytes(input_bytes - len(header)))
    return out


def _body(item: dict) -> dict:
    return {"receive_count": 2, "items": [item]}


def _burst(ctx: Context, path: str, media: list[bytes], ranks: list, baseline: int) -> dict[str, float]:
    """One burst of ``media`` through ``path``; the store's peak, what was staged, the return.

    Through the handle each item is an ``image_ref`` the caller stores as the burst starts
    (so its copy counts); over HTTP, base64 in the JSON body."""
    handle = serve.get_app_handle(standin.APP)
    url = f"{ctx.cluster['http_url']}/{standin.APP}/v1/encode"
    raw = [json.dumps(_body({"type": "image", "image": base64.b64encode(data).decode()})).encode() for data in media]

    async def burst() -> list[dict]:
        if path == "handle":
            bodies = [_body({"type": "image_ref", "image_ref": ray.put(data)}) for data in media]
            return await asyncio.gather(*(handle.encode.remote(body) for body in bodies))
        limits = httpx.Limits(max_connections=len(raw))
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            async def post(body: bytes) -> dict:
                response = await client.post(url, content=body, headers={"content-type": "application/json"})
                response.raise_for_status()
                return response.json()

            return await asyncio.gather(*(post(body) for body in raw))

    with _Sampler() as sampler:
        staged = asyncio.run(burst())
        staged_bytes = sum(item["nbytes"] for out in staged for item in out["items"])
        ctx.progress.step(f"memory: burst via {path}")
        ray.get([rank.fetch.remote(out["req_id"]) for out in staged for rank in ranks])
    del staged
    start = time.perf_counter()
    while (
        left := object_store_usage()[0] - baseline
    ) > _RETURN_TOLERANCE and time.perf_counter() - start < _RETURN_TIMEOUT_S:
        time.sleep(0.05)
    return {
        "baseline": baseline,
        "peak": sampler.peak - baseline,
        "samples": sampler.samples,
        "staged": staged_bytes,
        "back_s": time.perf_counter() - start,
        "left": left,
    }


def run(ctx: Context, app: standin.StandInApp) -> None:
    plan, results = ctx.plan, ctx.results
    handle = serve.get_app_handle(standin.APP)
    ranks = ctx.probes.ranks[:2]
    ray.get([rank.use_registry.remote(app.registry_name, app.namespace) for rank in ranks])
    media = _media(2 * plan.memory_burst)
    # Warm-up of the Ingress's handles and threads, with an item small enough to travel
    # inline: nothing of it is in the store, so the baseline need not wait for its free.
    tiny = base64.b64encode(standin.media(standin.TINY, "mem-warm")).decode()
    warm = handle.encode.remote({"receive_count": 2, "items": [{"type": "image", "image": tiny}]}).result()
    ray.get([rank.fetch.remote(warm["req_id"]) for rank in ranks])
    ctx.progress.step("memory: warm")
    input_bytes = len(png(INPUT_SIDE, seed=0))
    input_key = results.add(SECTION, "input_bytes_per_request", input_bytes, "B")
    gc.collect()
    baseline = _settled()
    for i, path in enumerate(PATHS):
        m = _burst(ctx, path, media[i * plan.memory_burst:(i + 1) * plan.memory_burst], ranks, baseline)
        _record(ctx, {"path": path}, m, input_key, input_bytes)
        if m["left"] > _RETURN_TOLERANCE:  # not back: the next burst needs a baseline of its own
            baseline = _settled()
    results.note(
        SECTION,
        (
            f"{plan.memory_burst} concurrent requests per path, each one item of {input_bytes / 1e6:.2f} MB "
            f"(a {INPUT_SIDE}x{INPUT_SIDE} random PNG's size) staged as a {EMBEDDING_BYTES / 1e6:.2f} MB "
            "embedding by the stand-in encoder, receive_count=2. Through the handle the caller stores each "
            "image (ray.put, counted: it happens during the burst) and sends an image_ref item, which the "
            "Ingress hashes and passes on unread; over HTTP the image is base64 in the JSON body, which the "
            "proxy streams to the Ingress, and the Ingress stores it once."
        ),
    )


def _record(ctx: Context, labels: dict, m: dict[str, float], input_key: str, input_bytes: int) -> None:
    results, burst = ctx.results, ctx.plan.memory_burst
    staged_key = results.add(SECTION, "staged_bytes", m["staged"], "B", labels, n=burst)
    peak_key = results.add(SECTION, "peak_store_bytes_above_baseline", m["peak"], "B", labels, n=m["samples"])
    results.add(SECTION, "baseline_store_bytes", m["baseline"], "B", labels)
    back_key = results.add(SECTION, "return_to_baseline_s", m["back_s"], "s", labels)
    left_key = results.add(SECTION, "bytes_left_after_release", m["left"], "B", labels)
    ratio = results.ratio(
        SECTION,
        "peak_per_staged_byte",
        m["peak"],
        m["staged"],
        [peak_key, staged_key],
        labels,
        how="(peak object-store bytes - baseline) / bytes of embeddings staged",
    )
    results.ratio(
        SECTION,
        "extra_peak_per_input_byte",
        m["peak"] - m["staged"],
        burst * input_bytes,
        [peak_key, staged_key, input_key],
        labels,
        how="(peak above baseline - staged bytes) / input bytes of the burst: copies of the inputs at the peak",
    )
    results.target(
        SECTION,
        "peak_per_staged_byte",
        ratio,
        "<=",
        1.1,
        "peak object-store bytes per staged byte during a burst <= 1.1",
        labels,
        inputs=[peak_key, staged_key],
    )
    results.target(
        SECTION,
        "returns_to_baseline",
        1.0 if m["left"] <= _RETURN_TOLERANCE else 0.0,
        "==",
        1.0,
        "object store back to its pre-burst level (within 1 MiB) after every rank fetched and let go",
        labels,
        inputs=[left_key, back_key],
    )
