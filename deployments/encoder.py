"""The ``Encoder`` deployment: GPU (or CPU) replicas running the vision tower with dynamic batching.

``encode`` takes one item; ``encode_many`` takes several and streams each result
back as its own object as soon as it is ready (the registry sends it the items
that reach it together, so under load one Serve call carries several). Decoding
and preprocessing run per item, outside the batch, so a bad image fails alone;
``@serve.batch`` then gathers prepared items from all callers into forward passes.
Batch size and wait are the deployment's ``user_config`` (``BatchConfig``) and can
change without a restart.

The result, an ``EncodedItem``, is returned by value: the registry actor is the
caller, so it owns the resulting object (each streamed one too) and the staged
bytes survive this replica's death.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

import ray
from ray import serve
from ray.serve import metrics

from deployments.autoscaling import ITEMS_METRIC
from deployments.config import BatchConfig, ModelConfig
from encoder import EncodedItem, Media, MediaError, PreparedItem, Video
from registry.errors import EncodeFailed, InvalidRequest, RegistryError, input_lost
from registry.logs import get_logger, quiet_client_errors

if TYPE_CHECKING:
    from encoder import VisionEncoder

logger = get_logger(__name__)

_FORWARD_BOUNDARIES_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]
_BATCH_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128]


@serve.deployment(
    name="Encoder",
    # Items queue here, where batching sees them, not in Serve's router: a caller whose
    # replicas are all full retries with a backoff of up to 0.5 s, which measured 10x less
    # throughput at 200 concurrent items (64 here) than with room for all of them. Each
    # ongoing item holds its input bytes, and once prepared its pixels, until its batch runs.
    max_ongoing_requests=512,
    # Bounded, so a flood surfaces as `overloaded` (BackPressureError) instead of memory growth.
    max_queued_requests=4096,
    user_config=BatchConfig().model_dump(),
    ray_actor_options={"num_cpus": 1},
)
class Encoder:
    def __init__(self, model: dict[str, Any] | None = None):
        # An undecodable image is the client's: the registry logs it once, with its req_id.
        quiet_client_errors()
        self._config = ModelConfig.model_validate(model or {})
        self._encoder = self._load(self._config)
        self._items = 0
        self._batches = 0
        self._in_progress = 0  # encode calls received and not answered yet
        self._batch = BatchConfig()
        self._batch_size = metrics.Histogram(
            "epd_encoder_batch_size", "Items per forward pass.", boundaries=_BATCH_BOUNDARIES
        )
        self._forward_s = metrics.Histogram(
            "epd_encoder_forward_s", "Seconds per batched forward pass.", boundaries=_FORWARD_BOUNDARIES_S
        )
        self._items_total = metrics.Counter("epd_encoder_items_total", "Items encoded by this replica.")

    def _load(self, config: ModelConfig) -> VisionEncoder:
        """The vision tower this replica runs; a subclass that brings its own overrides this."""
        from encoder import build_encoder  # imports torch: here, not where the Ingress imports this module

        return build_encoder(config.to_spec())

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        self._batch = BatchConfig.model_validate(user_config or {})
        self._encode_batch.set_max_batch_size(self._batch.max_batch_size)
        self._encode_batch.set_batch_wait_timeout_s(self._batch.batch_wait_timeout_s)

    async def encode(self, media: Media, req_id: str | None = None) -> EncodedItem:
        """Embed one media item: an image's raw bytes, or a ``Video`` of frames. ``req_id``
        (the first request that asked for it) only names the item in DEBUG lines."""
        self._in_progress += 1
        try:
            return await self._encode_one(media, req_id)
        finally:
            self._in_progress -= 1

    async def encode_many(self, media: list[Any], req_ids: list[str | None]) -> AsyncIterator[EncodedItem | RegistryError]:
        """Embed several items (each as ``encode`` takes it, or an ``ObjectRef`` of it) at once;
        a streaming call (``handle.options(stream=True)``) that yields, in item order, each
        item's ``EncodedItem`` or the ``RegistryError`` that item alone failed with."""
        if not isinstance(media, list) or not isinstance(req_ids, list) or len(media) != len(req_ids):
            raise InvalidRequest("encode_many takes a list of media and a list of as many req_ids")
        self._in_progress += len(media)
        # All at once, so they share forward passes with each other and with other callers.
        tasks = [asyncio.ensure_future(self._encode_ref(item, req_id)) for item, req_id in zip(media, req_ids)]
        try:
            for task in tasks:
                yield await _outcome(task)
        finally:
            for task in tasks:
                task.cancel()  # the caller went away: stop what has not run yet
            self._in_progress -= len(media)

    async def _encode_ref(self, media: Any, req_id: str | None) -> EncodedItem:
        if isinstance(media, ray.ObjectRef):  # inside a list, Ray hands the ref over unresolved
            try:
                media = await media
            except ray.exceptions.ObjectLostError:
                raise input_lost(req_id) from None
        return await self._encode_one(media, req_id)

    async def _encode_one(self, media: Media, req_id: str | None) -> EncodedItem:
        if not isinstance(media, (bytes, Video)):
            raise InvalidRequest(f"encode takes image bytes or a Video, got {type(media).__name__}")
        try:
            prepared = await asyncio.to_thread(self._encoder.prepare, media)
            encoded = await self._encode_batch(prepared)
            logger.debug("req_id=%s encoded: shape %s %s", req_id, encoded.meta["shape"], encoded.meta["dtype"])
            return encoded
        except MediaError as exc:
            raise InvalidRequest(str(exc)) from None

    # Until reconfigure() applies the user_config (Serve calls it before the first request).
    @serve.batch(max_batch_size=BatchConfig().max_batch_size, batch_wait_timeout_s=BatchConfig().batch_wait_timeout_s)
    async def _encode_batch(self, items: list[PreparedItem]) -> list[EncodedItem]:
        start = time.perf_counter()
        # Off the event loop, so requests keep queueing for the next batch meanwhile.
        encoded = await asyncio.to_thread(self._encoder.encode_batch, items)
        self._forward_s.observe(time.perf_counter() - start)
        self._batch_size.observe(len(items))
        self._items_total.inc(len(items))
        self._items += len(items)
        self._batches += 1
        return encoded

    async def ready(self) -> dict[str, Any]:
        """The model is loaded (the constructor finished); what runs where."""
        import torch  # loaded already, by the model; a module-level import would load it in the Ingress too

        return {
            "family": self._config.family,
            "device": str(self._encoder.device),
            "dtype": str(self._encoder.dtype).removeprefix("torch."),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "torch_threads": torch.get_num_threads(),
        }

    def record_autoscaling_stats(self) -> dict[str, int]:
        """What ``deployments.autoscaling.scale_on_items`` scales on (Serve asks with an
        ``autoscaling_config``): items in this replica, however many calls brought them."""
        return {ITEMS_METRIC: self._in_progress}

    async def identity(self) -> str:
        """The model identity inside every ``mm_hash`` this replica computes."""
        return self._encoder.identity

    async def stats(self) -> dict[str, Any]:
        """This replica's work (items encoded, forward passes, calls in progress) and batching settings."""
        return {
            "items_encoded": self._items,
            "batches": self._batches,
            "items_in_progress": self._in_progress,
            "pid": os.getpid(),
            **self._batch.model_dump(),
        }


async def _outcome(task: asyncio.Future) -> EncodedItem | RegistryError:
    """An item's result, or its failure as a value (a raised one would end the whole stream).
    The model's own exceptions become ``EncodeFailed`` with their type and text: that is what
    the registry reports, and they need not be picklable."""
    try:
        return await task
    except RegistryError as exc:
        return exc.fresh()
    except Exception as exc:  # noqa: BLE001 - one item's failure is reported, not raised
        return EncodeFailed(f"{type(exc).__name__}: {exc}")
    finally:
        # Re-raised here, the task's exception keeps this frame in its traceback; with the
        # task still in it, that is a reference cycle, which pinned the item's bytes (the
        # frames of its failed encode) until a garbage collection.
        del task
