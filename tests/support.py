"""Helpers shared by the tests: real image bytes, object-store readings, a TP-rank actor.

Nothing here stands in for Ray or Serve; the rank actor is a real Ray actor
using the real ``EmbeddingReceiver``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import time
from typing import Any, Callable

import numpy as np
import ray
from PIL import Image

from encoder import EncoderSpec, build_encoder

# The app the integration tests deploy. bfloat16 is the harder transport path
# (its bits travel as int16), so the shared app uses it even on the CPU.
MODEL_SPEC = {"dtype": "bfloat16"}
APP_ARGS = {
    "default_receive_count": 2,
    "max_request_bytes": 4 * 1024 * 1024,
    "max_item_bytes": 2 * 1024 * 1024,
    "model": MODEL_SPEC,
}


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A real encoded image of random pixels."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_item(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def reference_embedding(data: bytes, **spec: Any) -> np.ndarray:
    """The embedding computed in this process, unbatched, as staged (payload array)."""
    encoder = build_encoder(EncoderSpec(**spec))
    return encoder.encode_batch([encoder.preprocess(data)])[0].payload


def object_store_usage() -> tuple[int, int]:
    """(bytes used, objects) in the object store of every node of the current cluster."""
    from ray._private import internal_api

    state = internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)
    stats = internal_api.get_memory_info_reply(state).store_stats
    return int(stats.object_store_bytes_used), int(stats.num_local_objects)


def registry_stats() -> dict[str, int]:
    from registry import lookup_registry

    return ray.get(lookup_registry().stats.remote())


def wait_until(condition: Callable[[], Any], timeout_s: float = 15.0, interval_s: float = 0.1, what: str = "") -> Any:
    """Poll ``condition`` until it is truthy (tests only: the product never polls)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or condition}")
        time.sleep(interval_s)


@ray.remote(num_cpus=0, max_concurrency=1000)
class RankActor:
    """A decoder TP rank: fetches with ``EmbeddingReceiver`` and reports what it got."""

    def __init__(self, rank: int):
        from registry import EmbeddingReceiver

        self.rank = rank
        self.receiver = EmbeddingReceiver(rank=rank)
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

    def fetch_sync(self, req_id: str, timeout_s: float = 30.0) -> list[str]:
        """The blocking API; returns sha256 of each item's bytes."""
        items = self.receiver.fetch(req_id, timeout_s=timeout_s)
        return [hashlib.sha256(_raw(item.tensor)).hexdigest() for item in items]

    def drop(self) -> int:
        count = len(self.held)
        self.held.clear()
        return count


def _raw(tensor) -> bytes:
    import torch

    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()
