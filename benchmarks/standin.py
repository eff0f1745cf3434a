"""A stand-in model inside the real ``Encoder`` deployment: a free forward pass of exact output size.

``StandInEncoder`` is the project's ``Encoder`` deployment class (subclassed, so
every call the registry makes, ``identity`` and ``encode``, runs the real code: the thread hops, ``@serve.batch``, the
return path) with one change: its vision tower is ``StandInModel``, whose
outputs are bfloat16 tensors computed once at start. A call therefore costs
exactly what happens around and *after* a forward pass: building the
``EncodedItem`` (no copy on CPU) and Ray storing the returned payload in the
object store for the caller, the registry, which owns it.

Used by the fetch, staging and registry sections, which measure the staging
and transport of embeddings, not a model. The media bytes name the output size:
``b"standin:<nbytes>:<nonce>"`` (the nonce makes every item's hash unique), or,
where a route takes only images (SGLang's), a PNG whose height is the rows
(``image_media``).
Batches run as soon as the previous one is done (``batch_wait_timeout_s`` 0),
so no batching delay is added before the "forward pass".

It also times, inside the same replica process, the baselines staging is
compared with: ``ray.put`` of the same payload, and memcpys of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import time
import uuid
from typing import Any, Iterator, Sequence

import numpy as np
import ray
import torch
from PIL import Image
from ray import serve

from benchmarks.cluster import local_cluster, run_token, start_serve
from benchmarks.probes import fresh_copy
from deployments.encoder import Encoder as _EncoderDeployment
from encoder import EncodedItem, PreparedItem, VisionEncoder
from registry import media_input

IDENTITY = "standin:bf16:v1"
APP = "bench-standin"
# Columns of every stand-in embedding: a 7B-class language model's hidden size.
WIDTH = 4096
_ROW_BYTES = WIDTH * 2  # bfloat16
_EMPTY = torch.empty(0)
# The smallest output: one row, 8 KB, small enough to travel inline in Ray's replies.
TINY = _ROW_BYTES


def media(nbytes: int, nonce: str) -> bytes:
    """The media item that makes the stand-in return an embedding of ``nbytes`` bytes."""
    if nbytes % _ROW_BYTES:
        raise ValueError(f"stand-in sizes are whole rows of {_ROW_BYTES} bytes, got {nbytes}")
    return f"standin:{nbytes}:{nonce}".encode()


def image_media(nbytes: int, seed: int) -> bytes:
    """A PNG that makes the stand-in return an embedding of ``nbytes``: one pixel row per
    embedding row, random pixels (``seed``) so every image's hash differs."""
    if nbytes % _ROW_BYTES:
        raise ValueError(f"stand-in sizes are whole rows of {_ROW_BYTES} bytes, got {nbytes}")
    pixels = np.random.default_rng(seed).integers(0, 256, (nbytes // _ROW_BYTES, 16, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class StandInModel(VisionEncoder):
    """A ``VisionEncoder`` whose embeddings are ready-made: ``nbytes`` from the media -> that tensor."""

    family = "standin"

    def __init__(self, sizes: Sequence[int]):
        self.identity = IDENTITY
        self.device = torch.device("cpu")
        self.dtype = torch.bfloat16
        generator = torch.Generator().manual_seed(0)
        self.tensors = {n: torch.randn(n // _ROW_BYTES, WIDTH, generator=generator).to(torch.bfloat16) for n in sizes}

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
        self._held: list[Any] = []
        # Warm buffers for the memcpy baseline: touched once, so copies into them fault no pages.
        self._dst = {n: np.ones(n, dtype=np.uint8) for n in sizes}

    def _load(self, config: Any) -> VisionEncoder:
        return StandInModel(self._sizes)

    async def copies_before_store(self, nbytes: int) -> int:
        """Copies ``EncodedItem.from_tensor`` makes of the output: 0 if the payload is a view."""
        tensor = self._encoder.tensors[nbytes]
        payload = EncodedItem.from_tensor(tensor, PreparedItem(_EMPTY, "x", {}, ())).payload
        return 0 if payload.ctypes.data == tensor.data_ptr() else 1

    async def put(self, nbytes: int, hold: bool = False) -> float:
        """Seconds for ``ray.put`` of this size's payload (int16 view of the bf16 tensor, as staged).

        ``hold`` keeps the object alive, so that the next put lands in fresh object-store pages.
        """
        payload = self._encoder.tensors[nbytes].view(torch.int16).numpy()
        start = time.perf_counter()
        ref = ray.put(payload)
        elapsed = time.perf_counter() - start
        if hold:
            self._held.append(ref)
        return elapsed

    async def release(self) -> int:
        count = len(self._held)
        self._held.clear()
        return count

    async def memcpy(self, nbytes: int) -> dict[str, float]:
        """Seconds for one memcpy of the payload into a warm buffer and into fresh pages."""
        src = self._encoder.tensors[nbytes].view(torch.uint8).numpy().reshape(-1)
        dst = self._dst[nbytes]
        start = time.perf_counter()
        np.copyto(dst, src)
        warm = time.perf_counter() - start
        start = time.perf_counter()
        fresh_copy(src)
        cold = time.perf_counter() - start
        return {"warm": warm, "fresh": cold}


StandInDeployment = serve.deployment(
    StandInEncoder,
    name="Encoder",
    max_ongoing_requests=1024,
    ray_actor_options={"num_cpus": 0},
    user_config={"max_batch_size": 8, "batch_wait_timeout_s": 0.0},
)


@dataclasses.dataclass
class StandInApp:
    """The stand-in app (Ingress -> registry -> stand-in Encoder), deployed."""

    encoder: Any  # DeploymentHandle of the stand-in Encoder (for its baseline methods)
    registry: Any  # ActorHandle of the app's registry
    registry_name: str
    namespace: str

    def submit(self, nbytes: int, receive_count: int, wait: bool = True) -> tuple[str, float]:
        """Submit one stand-in item of ``nbytes``; (req_id, seconds until the call returned)."""
        req_id = uuid.uuid4().hex
        start = time.perf_counter()
        ray.get(self.registry.submit.remote(req_id, [media_input(media(nbytes, req_id))], req_id, receive_count, wait))
        return req_id, time.perf_counter() - start

    def cancel(self, req_id: str) -> None:
        ray.get(self.registry.cancel.remote(req_id))


def _config(registry_name: str, namespace: str, **overrides: Any) -> Any:
    from deployments import AppConfig

    return AppConfig.model_validate(
        {
            "registry_name": registry_name,
            "registry_namespace": namespace,
            "cache_max_bytes": 0,
            "model": {"family": "tiny-vit", "dtype": "bfloat16"},
            **overrides,
        }
    )


def application(sizes: list[int], registry_name: str, namespace: str, **overrides: Any) -> Any:
    """The real ``Ingress`` in front of the stand-in: deploy it under ``APP`` (HTTP under ``/APP``).

    The Ingress creates the registry, as the real app does; only its encoder is the
    stand-in, and the content-hash cache is off (every item is new). ``overrides``: other
    app config keys.
    """
    from deployments import Ingress

    config = _config(registry_name, namespace, **overrides)
    encoder = StandInDeployment.bind(sorted({*sizes, TINY}))
    return Ingress.options(ray_actor_options={"num_cpus": 0}).bind(encoder, config.model_dump())


def connect(registry_name: str, namespace: str) -> StandInApp:
    """The deployed stand-in app's handles (its registry is up once the app is)."""
    registry = ray.get_actor(registry_name, namespace=namespace)
    ray.get(registry.ping.remote())
    return StandInApp(serve.get_deployment_handle("Encoder", APP), registry, registry_name, namespace)


def deploy_on(resource: str, sizes: list[int], registry_name: str, namespace: str, app: str) -> StandInApp:
    """Deploy the stand-in Encoder alone, with a registry of its own, both on the node that
    offers ``resource``, as app ``app``: for measurements that call the registry directly.

    The registry is the project's actor class, created here because the Ingress would pin
    it to the head node: on another node than its encoder, every result would also cross
    to the head (Serve's router reads it), which is not the hand-off being measured.
    """
    from registry.server.actor import EmbeddingRegistry

    there = {"num_cpus": 0, "resources": {resource: 0.01}}
    settings = _config(registry_name, namespace).registry_settings(encoder_app=app)
    # Created first: it starts while Serve starts the replica. This handle is kept, not one
    # looked up by name later: the actor lives while its creator's handle does.
    registry = (
        ray.remote(EmbeddingRegistry)
        .options(name=registry_name, namespace=namespace, max_concurrency=settings.registry_max_concurrency, **there)
        .remote(settings)
    )
    encoder = serve.run(
        StandInDeployment.options(ray_actor_options=there).bind(sorted({*sizes, TINY})), name=app, route_prefix=None
    )
    ray.get(registry.configure.remote(settings))
    return StandInApp(encoder, registry, registry_name, namespace)


@contextlib.contextmanager
def served_alone(name: str, sizes: Sequence[int]) -> Iterator[dict[str, str]]:
    """A fresh local cluster serving the stand-in app (Ingress included) under ``/APP``, for a
    benchmark that runs on its own: yields its ``namespace``, ``token``, ``registry_name``
    and ``http_url``."""
    token = run_token()
    namespace = f"epd-{name}-{token}"
    with local_cluster(namespace):
        http_url = start_serve()["http_url"]
        registry_name = f"{name}_{token}"
        serve.run(application(list(sizes), registry_name, namespace), name=APP, route_prefix=f"/{APP}")
        yield {"namespace": namespace, "token": token, "registry_name": registry_name, "http_url": http_url}
