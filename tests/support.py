"""Helpers shared by the tests: real image bytes, object-store readings, a TP-rank actor.

Nothing here stands in for Ray or Serve; the rank actor is a real Ray actor
using the real ``EmbeddingReceiver``.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import time
from typing import Any, Callable

import numpy as np
import pytest
import ray
from PIL import Image

# Object-store accounting and log locations reach into Ray's private modules: one home for that.
from benchmarks.cluster import object_store_usage  # noqa: F401
from ray_readings import global_gc, logs_dir, object_refs_in_use  # noqa: F401
from encoder import EncoderSpec, build_encoder
from registry.server.inputs import INLINE_MAX_BYTES

# The app the integration tests deploy: tiny-vit, whose token count is simply
# (height/16) x (width/16), in bfloat16, the harder transport path (its bits travel
# as int16), even on the CPU.
MODEL_SPEC = {"family": "tiny-vit", "dtype": "bfloat16"}
APP_ARGS = {
    "default_receive_count": 2,
    # Off here: cached embeddings stay in the object store by design, and every test
    # checks the store returns to its baseline. tests/integration/test_cache.py turns it on.
    "cache_max_bytes": 0,
    "max_request_bytes": 4 * 1024 * 1024,
    "max_item_bytes": 2 * 1024 * 1024,
    # Short, so a test whose HTTP ranks never acknowledge waits seconds for their release.
    "http_pull_grace_s": 3.0,
    "model": MODEL_SPEC,
}


@contextlib.contextmanager
def media_server(files: dict[str, bytes]):
    """A real HTTP server on 127.0.0.1 serving ``files`` by path, plus ``/redirect/<path>``
    (302 to that path). Yields its base URL (``http://localhost:<port>``)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            if self.path.startswith("/redirect/"):
                self.send_response(302)
                self.send_header("Location", self.path.removeprefix("/redirect"))
                self.end_headers()
                return
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://localhost:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def shown_ratio(num: float, den: float, places: int = 3, den_terms: int = 1, ratio_places: int = 2) -> Any:
    """``num / den`` as a report shows it: its ratios come from the unrounded values,
    while ``num`` and ``den`` (a sum of ``den_terms`` values) are shown rounded to
    ``places``. Leaves room for both roundings, so a small denominator cannot fail a check."""
    ratio = num / den
    half = 0.5 * 10**-places
    room = ratio * (half / num + den_terms * half / den) * 1.01 + 0.5 * 10**-ratio_places + 1e-9
    return pytest.approx(ratio, abs=room)


def registry_settings(name: str, namespace: str = "epd-tests", encoder_app: str = "epd", **app_args: Any):
    """Settings of a registry of a test's own, built as the app builds them (``AppConfig``)."""
    from deployments import AppConfig

    config = AppConfig.model_validate({"registry_name": name, "registry_namespace": namespace, **app_args})
    return config.registry_settings(encoder_app=encoder_app)


# A stopping replica checks for requests still running every 0.2 s, not Serve's 2 s: a
# deleted or replaced app is gone in 1 s instead of 3, and it still drains what it runs.
DRAIN = {"graceful_shutdown_wait_loop_s": 0.2}


def deployment_options(**encoder_user_config: Any) -> dict[str, dict[str, Any]]:
    """Serve options of the integration tests' app; keyword arguments change the Encoder's batching."""
    from deployments import BatchConfig

    encoder = {
        # A fake GPU: Ray schedules and sets CUDA_VISIBLE_DEVICES; torch still runs on the CPU.
        "ray_actor_options": {"num_gpus": 1, "num_cpus": 0},
        "user_config": {**BatchConfig().model_dump(), **encoder_user_config},
        **DRAIN,
    }
    return {"Encoder": encoder, "Ingress": {"ray_actor_options": {"num_cpus": 0}, **DRAIN}}


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A real encoded image of random pixels. A PNG is stored without compression: random
    pixels do not compress, and zlib trying took 40% of the time of making 1,000 of them."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, **({"compress_level": 0} if fmt == "PNG" else {}))
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_item(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


@contextlib.contextmanager
def one_thread():
    """Run torch on one intra-op thread (as a replica with one CPU does), then restore.

    Multi-threaded BLAS may split a matmul's rows differently for different batch
    sizes, which moves the last bits of a batched result; on one thread a batch
    gives the same bits as each item alone.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference_embedding(data: bytes, **spec: Any) -> np.ndarray:
    """The embedding computed in this process, unbatched, as staged (payload array)."""
    encoder = _reference_encoder(json.dumps(spec, sort_keys=True))
    return encoder.encode_batch([encoder.preprocess(data)])[0].payload


@functools.lru_cache(maxsize=4)
def _reference_encoder(spec: str):
    # Built once per spec (its JSON): some tests compare every item they staged with it, and
    # building the model costs more than encoding one small image with it.
    return build_encoder(EncoderSpec(**json.loads(spec)))


# Ray stores objects larger than this in the shared-memory object store and
# smaller ones inline in their owner's memory (RAY_max_direct_call_object_size).
INLINE_OBJECT_LIMIT = INLINE_MAX_BYTES


# For the _system_config of the clusters the tests start. Ray lets a worker collect garbage at
# most once per local_gc_min_interval_s (10 s by default), so a leak check that asks for a
# collection (``stored_objects(collect=True)``) would wait up to that long for it. 1 s, as
# Ray's own test clusters run.
COLLECT_EVERY_SECOND = {"local_gc_min_interval_s": 1}


def stored_objects(collect: bool = False) -> dict[bytes, tuple[int, list[str]]]:
    """The object-store objects (over ``INLINE_OBJECT_LIMIT``) that any process of the
    cluster references, Serve's control plane aside: id -> (bytes, holders).

    ``collect`` runs the garbage collector in every worker first: refs caught in reference
    cycles (Serve's router keeps some failed calls to a dead replica in them) are garbage a
    busy process collects on its own, not leaks. Ray runs it in a worker at most once per
    ``local_gc_min_interval_s`` (see ``COLLECT_EVERY_SECOND``): a request made sooner is
    carried out then.
    """
    if collect:
        global_gc()
    return {oid: (size, holders) for oid, (size, holders) in object_refs_in_use().items() if size > INLINE_OBJECT_LIMIT}


def object_store_bytes_in_use() -> int:
    """Bytes of the ``stored_objects``, garbage collected first; each object counted once."""
    return sum(size for size, _ in stored_objects(collect=True).values())


def registry_stats(name: str | None = None, namespace: str | None = None) -> dict[str, int]:
    """The registry's stats, summed over its shards (what ``GET /v1/stats`` answers)."""
    from registry import lookup_shards
    from registry.routing import sum_stats

    return sum_stats(ray.get([shard.stats.remote() for shard in lookup_shards(name, namespace).handles]))


def holds_nothing(stats: dict[str, int]) -> bool:
    """Whether a registry with these ``stats`` holds no request, no staged entry and no ref."""
    return stats["pending"] == 0 and stats["staged"] == 0 and stats["live_refs"] == 0


def wait_until(condition: Callable[[], Any], timeout_s: float = 15.0, interval_s: float = 0.1, what: str = "") -> Any:
    """Poll ``condition`` until it is truthy (tests only: the product never polls)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or condition} (last: {value!r})")
        time.sleep(interval_s)


@contextlib.contextmanager
def deployed(*targets: Any):
    """Serve apps (``serve.RunTarget``s) deployed together and, at the end, deleted together,
    so that their replicas start side by side and drain side by side; yields their handles."""
    from ray import serve

    handles = serve.run_many(list(targets))
    try:
        yield handles
    finally:
        names = {target.name for target in targets}
        for name in names:
            serve.delete(name, _blocking=False)
        wait_until(lambda: not names & set(serve.status().applications), 60, what=f"apps {sorted(names)} deleted")


@ray.remote(num_cpus=0, max_concurrency=1000)
class RankActor:
    """A decoder TP rank: fetches with ``EmbeddingReceiver`` and reports what it got."""

    def __init__(self, rank: int, registry_name: str | None = None, registry_namespace: str | None = None):
        from registry import EmbeddingReceiver

        self.rank = rank
        self.receiver = EmbeddingReceiver(rank=rank, registry_name=registry_name, registry_namespace=registry_namespace)
        self.held: list[Any] = []

    async def fetch(
        self, req_id: str, timeout_s: float = 30.0, hold: bool = False, digests: bool = False
    ) -> dict[str, Any]:
        """Fetch; report metas, dtypes, raw bytes (or their sha256) and data pointers, or the error."""
        from registry import RegistryError

        try:
            items = await self.receiver.fetch_async(req_id, timeout_s=timeout_s)
        except RegistryError as exc:
            return {"error": exc.code, "message": exc.message, "type": type(exc).__name__, "details": exc.details}
        if hold:
            self.held.extend(items)
        raw = [_raw(item.tensor) for item in items]
        return {
            "metas": [item.meta for item in items],
            "dtypes": [str(item.tensor.dtype).removeprefix("torch.") for item in items],
            "shapes": [list(item.tensor.shape) for item in items],
            "bytes": [hashlib.sha256(b).hexdigest() for b in raw] if digests else raw,
            "data_ptrs": [item.tensor.data_ptr() for item in items],
        }

    async def fetch_many(self, req_ids: list[str], timeout_s: float = 30.0) -> dict[str, list[str] | str]:
        """A batch on this actor's event loop: per req_id, sha256 of each item's bytes or the error code."""
        from registry import RegistryError

        out = await self.receiver.fetch_many_async(req_ids, timeout_s=timeout_s)
        return {
            req_id: value.code if isinstance(value, RegistryError)
            else [hashlib.sha256(_raw(item.tensor)).hexdigest() for item in value]
            for req_id, value in out.items()
        }

    def fetch_sync(self, req_id: str, timeout_s: float = 30.0) -> list[str]:
        """The blocking API; returns sha256 of each item's bytes."""
        items = self.receiver.fetch(req_id, timeout_s=timeout_s)
        return [hashlib.sha256(_raw(item.tensor)).hexdigest() for item in items]

    def drop(self) -> int:
        count = len(self.held)
        self.held.clear()
        return count

    def blocked_its_loop(self) -> bool:
        """Whether a blocking ``ray.get`` ran in this async actor (Ray then warns, once per
        process, "Using blocking ray.get inside async actor")."""
        from ray._private import worker

        return worker.blocking_get_inside_async_warned

    def loaded(self, modules: list[str]) -> list[str]:
        """Which of ``modules`` this process has imported."""
        import sys

        return [m for m in modules if m in sys.modules]


@dataclasses.dataclass
class OwnApp:
    """An app a test deployed for itself beside the suite's (``own_app``)."""

    name: str  # its Serve app name; its HTTP API is under "/<name>"
    registry: tuple[str, str]  # its registry's name and namespace
    ranks: list  # RankActors of its registry

    @property
    def prefix(self) -> str:
        return f"/{self.name}"

    def stats(self) -> dict[str, int]:
        return registry_stats(*self.registry)


@contextlib.contextmanager
def own_app(
    app_args: dict[str, Any], options: dict[str, dict[str, Any]], tag: str, shards: int = 1, ranks: int = 0,
    logging_config: Any = None,
):
    """An app of its own, for a test that needs another configuration than the suite's:
    ``app_args`` with a registry of ``shards`` shards of its own, ``ranks`` RankActors that
    fetch from it, and Serve's ``logging_config`` if given. (Redeploying the suite's app and
    back would start its replicas twice: ``serve.run`` from Python starts new ones for any
    change.)

    On a normal exit its registry must be empty, as ``no_leaks`` asks of the suite's; then
    the app, its registry and its ranks are removed."""
    import uuid

    from ray import serve

    from deployments import compose_app
    from registry import lookup_shards
    from registry.errors import Unavailable

    name = f"epd-{tag}-{uuid.uuid4().hex[:6]}"
    registry = (f"{name}-registry", "epd")
    app = compose_app({**app_args, "registry_name": registry[0], "registry_namespace": registry[1],
                       "registry_shards": shards}, deployment_options=options)
    actors = [RankActor.remote(r, *registry) for r in range(ranks)]
    try:
        with deployed(serve.RunTarget(app, name=name, route_prefix=f"/{name}", logging_config=logging_config)):
            yield (deployed_app := OwnApp(name, registry, actors))
            wait_until(lambda: holds_nothing(deployed_app.stats()), 20, what=f"the registry of {name} to be empty")
    finally:
        for actor in actors:
            ray.kill(actor)
        with contextlib.suppress(Unavailable):  # it never started
            for shard in lookup_shards(*registry).handles:
                ray.kill(shard)


def _raw(tensor) -> bytes:
    import torch

    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def log_lines_since(offsets: dict[str, int], patterns: tuple[str, ...] = ("serve/*.log", "worker-*.err", "worker-*.out")) -> dict[str, list[str]]:
    """Lines added to the cluster's log files since ``offsets`` (file -> size; see
    ``log_offsets``), per file."""
    import glob
    import os

    added = {}
    for pattern in patterns:
        for path in glob.glob(os.path.join(logs_dir(), pattern)):
            with open(path, "rb") as f:
                f.seek(offsets.get(path, 0))
                text = f.read().decode(errors="replace")
            if text:
                added[path] = text.splitlines()
    return added


def log_offsets() -> dict[str, int]:
    """The current size of every log file of the cluster."""
    import glob
    import os

    return {path: os.path.getsize(path) for path in glob.glob(os.path.join(logs_dir(), "**", "*"), recursive=True) if os.path.isfile(path)}
