"""A stand-in model inside the real ``Encoder`` deployment: a free forward pass of exact output size.

``StandInEncoder`` subclasses the project's ``Encoder`` deployment, so every call the registry
makes runs the real code (thread hops, ``@serve.batch``, the return path); only its tower is
``StandInModel``, whose bf16 outputs are made once at start. A call so costs what happens
around and after a forward pass: the ``EncodedItem`` (no copy) and Ray's store write of it.
The media name the output size: ``b"standin:<nbytes>:<nonce>"``, or a PNG with a pixel row
per embedding row (``image_media``, for routes that take images only). The replica also
times staging's baselines in its own process: ``ray.put`` and a memcpy of the payload.
"""

from __future__ import annotations

import dataclasses
import io
import time
import uuid
from typing import Any, Sequence

import numpy as np
import ray
import torch
from PIL import Image
from ray import serve

from deployments.encoder import Encoder as _EncoderDeployment
from encoder import EncodedItem, PreparedItem, VisionEncoder
from registry import media_input

APP = "bench-standin"
WIDTH = 4096  # columns of every stand-in embedding: a 7B-class language model's hidden size
_ROW_BYTES = WIDTH * 2  # bfloat16
_EMPTY = torch.empty(0)
TINY = _ROW_BYTES  # the smallest output, one row: 8 KB, small enough to travel inline in Ray's replies
# The stand-in app's variants: the default batched calls, and one Encoder call per item and
# one registry call per request (the ingress section runs both side by side).
VARIANTS: dict[str, dict[str, int]] = {"batched": {}, "single": {"encoder_call_max_items": 1, "registry_call_max_requests": 1}}


def app_name(variant: str) -> str:
    return APP if variant == "batched" else f"{APP}-{variant}"


def _rows(nbytes: int) -> int:
    if nbytes % _ROW_BYTES:
        raise ValueError(f"stand-in sizes are whole rows of {_ROW_BYTES} bytes, got {nbytes}")
    return nbytes // _ROW_BYTES


def media(nbytes: int, nonce: str) -> bytes:
    """The media item that makes the stand-in return an embedding of ``nbytes`` bytes."""
    _rows(nbytes)
    return f"standin:{nbytes}:{nonce}".encode()


def image_media(nbytes: int, seed: int) -> bytes:
    """A PNG that makes the stand-in return an embedding of ``nbytes``: one pixel row per
    embedding row, random pixels (``seed``) so every image's hash differs."""
    pixels = np.random.default_rng(seed).integers(0, 256, (_rows(nbytes), 16, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class StandInModel(VisionEncoder):
    """A ``VisionEncoder`` whose embeddings are ready-made: ``nbytes`` from the media -> that tensor."""

    family = "standin"

    def __init__(self, sizes: Sequence[int]):
        self.identity = "standin:bf16:v1"
        self.device = torch.device("cpu")
        self.dtype = torch.bfloat16
        generator = torch.Generator().manual_seed(0)
        self.tensors = {n: torch.randn(_rows(n), WIDTH, generator=generator).to(torch.bfloat16) for n in sizes}

    def preprocess(self, data: bytes) -> PreparedItem:
        if data.startswith(b"\x89PNG"):
            nbytes = Image.open(io.BytesIO(data)).size[1] * _ROW_BYTES
        else:
            nbytes = int(data.split(b":")[1])
        return PreparedItem(pixels=_EMPTY, mm_hash=self.mm_hash(data), meta={}, batch_key=(nbytes,))

    def embed(self, items: Sequence[PreparedItem]) -> list[torch.Tensor]:
        return [self.tensors[item.batch_key[0]] for item in items]


class StandInEncoder(_EncoderDeployment.func_or_class):
    def __init__(self, sizes: list[int]):
        self._sizes = sizes
        super().__init__({"family": "tiny-vit", "dtype": "bfloat16"})  # the config's model is never built
        # Warm buffers for the memcpy baseline: touched once, so copies into them fault no pages.
        self._dst = {n: np.ones(n, dtype=np.uint8) for n in sizes}

    def _load(self, config: Any) -> VisionEncoder:
        return StandInModel(self._sizes)

    async def copies_before_store(self, nbytes: int) -> int:
        """Copies ``EncodedItem.from_tensor`` makes of the output: 0 if the payload is a view."""
        tensor = self._encoder.tensors[nbytes]
        payload = EncodedItem.from_tensor(tensor, PreparedItem(_EMPTY, "x", {}, ())).payload
        return 0 if payload.ctypes.data == tensor.data_ptr() else 1

    async def put(self, nbytes: int) -> float:
        """Seconds for ``ray.put`` of this size's payload (the int16 view of the bf16 tensor, as staged)."""
        payload = self._encoder.tensors[nbytes].view(torch.int16).numpy()
        start = time.perf_counter()
        ray.put(payload)
        return time.perf_counter() - start

    async def memcpy(self, nbytes: int) -> float:
        """Seconds for one memcpy of the payload into a warm buffer."""
        src = self._encoder.tensors[nbytes].view(torch.uint8).numpy().reshape(-1)
        start = time.perf_counter()
        np.copyto(self._dst[nbytes], src)
        return time.perf_counter() - start


StandInDeployment = serve.deployment(
    StandInEncoder, name="Encoder", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0},
    user_config={"max_batch_size": 8, "batch_wait_timeout_s": 0.0},
)


@dataclasses.dataclass
class StandInApp:
    """The stand-in app (Ingress -> registry -> stand-in Encoder), deployed."""

    encoder: Any  # DeploymentHandle of the stand-in Encoder (for its baseline methods)
    registry: Any  # ActorHandle of the app's registry
    registry_name: str
    namespace: str

    def submit(self, nbytes: int, receive_count: int) -> tuple[str, float]:
        """Submit one stand-in item of ``nbytes`` and wait until it is staged; (req_id, seconds)."""
        req_id = uuid.uuid4().hex
        start = time.perf_counter()
        ray.get(self.registry.submit.remote(req_id, [media_input(media(nbytes, req_id))], req_id, receive_count, True))
        return req_id, time.perf_counter() - start

    def cancel(self, req_id: str) -> None:
        ray.get(self.registry.cancel.remote(req_id))


def application(sizes: Sequence[int], registry_name: str, namespace: str, **overrides: Any) -> Any:
    """The real ``Ingress`` (which creates the registry, as in the real app) in front of the stand-in,
    the content-hash cache off so that every item is new; ``overrides``: other app config keys."""
    from deployments import AppConfig, Ingress

    config = AppConfig.model_validate({"registry_name": registry_name, "registry_namespace": namespace,
                                       "cache_max_bytes": 0, "model": {"family": "tiny-vit", "dtype": "bfloat16"},
                                       **overrides})
    encoder = StandInDeployment.bind(sorted({*sizes, TINY}))
    return Ingress.options(ray_actor_options={"num_cpus": 0}).bind(encoder, config.model_dump())


def connect(registry_name: str, namespace: str) -> StandInApp:
    """The deployed stand-in app's handles (its registry is up once the app is)."""
    registry = ray.get_actor(registry_name, namespace=namespace)
    return StandInApp(serve.get_deployment_handle("Encoder", APP), registry, registry_name, namespace)
