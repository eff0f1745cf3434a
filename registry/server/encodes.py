"""How the registry gets an item encoded: cache, in-flight sharing, then one Encoder call.

For each item (a ``MediaInput``: the bytes' digest, and the bytes or a ref to
them, which this process never reads) the registry computes its ``mm_hash`` (the
digest under the serving model's identity, the same hash the encoder computes
from the bytes and reports) and, in order:

1. a cache hit hands back the staged item already held (no model run, no copy);
2. an identical item being encoded right now is awaited, not encoded again
   (so duplicates in one request, or in one batch, run once);
3. otherwise the item goes to the ``Encoder`` deployment (``registry.server.batched_calls``,
   which sends the items that reach it together in one call), in a task shared by
   everyone waiting for that hash. It is cancelled only when its last waiter is.

The call is made from this process, so the result's ObjectRef is owned here and
outlives the replica that computed it. A result is cached only if its reported
``mm_hash`` equals the key: if the model changed under us (a redeploy), the
identity is fetched again instead of caching under a stale key.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from typing import Any

from ray import serve
from ray.exceptions import ObjectLostError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RayServeException

from encoder.hashing import mm_hash
from registry.server.cache import EncoderCache
from registry.server.batched_calls import EncoderCalls
from registry.errors import EncodeFailed, Overloaded, RegistryError, Unavailable, input_lost, unwrap
from registry.server.inputs import INLINE_MAX_BYTES, MediaInput
from registry.settings import RegistrySettings
from registry.server.state import StagedItem


def encode_error(exc: BaseException, req_id: str, index: int) -> RegistryError:
    """Map whatever one item's encode raised to a registry error naming the item."""
    exc = unwrap(exc)
    if isinstance(exc, RegistryError):
        return exc.fresh(message=f"items[{index}]: {exc.message}", req_id=req_id)
    if isinstance(exc, BackPressureError):  # the Encoder's max_queued_requests was hit
        return Overloaded(f"items[{index}]: the encoder queue is full; retry later", req_id)
    if isinstance(exc, (DeploymentUnavailableError, RayServeException)):
        return Unavailable(f"items[{index}]: the encoder deployment is not available: {exc}", req_id)
    if isinstance(exc, RayActorError):  # the replica died, and so did the one that took the retry
        return Unavailable(
            f"items[{index}]: the encoder replica died while encoding it, and so did the retry's; "
            "retry the request shortly", req_id,
        )
    if isinstance(exc, ObjectLostError):  # the input's owner (the caller's ingress replica) died
        return encode_error(input_lost(req_id), req_id, index)
    # The model's own exception, not Ray's wrapper (whose text is a colored header of the
    # replica's actor ids, then the remote traceback): that is what an operator needs to read.
    cause = getattr(exc, "cause", None) or exc
    return EncodeFailed(f"items[{index}]: {type(cause).__name__}: {cause}", req_id)


@dataclasses.dataclass
class _Shared:
    task: asyncio.Task
    waiters: int = 0


class EncoderClient:
    """The registry's way to the Encoder deployment its ``RegistrySettings`` name."""

    def __init__(self, settings: RegistrySettings):
        self._target = (settings.encoder_app, settings.encoder_deployment)
        self._handle: Any = None
        self._identity: asyncio.Task | None = None  # asks the Encoder for its model identity, once
        self.cache = EncoderCache(settings.cache_max_bytes)
        self._calls = EncoderCalls(self._deployment, settings.encoder_call_max_items)
        self._inflight: dict[str, _Shared] = {}
        self.joined = 0  # items that joined an identical item's encode in flight

    def reconfigure(self, settings: RegistrySettings) -> None:
        target = (settings.encoder_app, settings.encoder_deployment)
        if target != self._target:
            self._target, self._handle = target, None
            self.cache.clear()
        self.cache.max_bytes = settings.cache_max_bytes
        self._calls.max_items = settings.encoder_call_max_items
        self._identity = None  # a (re)deploy may have changed the model: ask again

    async def encode(self, req_id: str, index: int, item: MediaInput) -> StagedItem:
        """The staged item for ``item``; raises a ``RegistryError`` naming ``req_id`` and ``index``."""
        try:
            key = mm_hash(item.digest, await self._model_identity())
        except Exception as exc:  # noqa: BLE001
            raise encode_error(exc, req_id, index) from None
        cached = self.cache.get(key) if self.cache.max_bytes > 0 else None
        if cached is not None:
            return cached
        while True:
            shared = self._shared(key, item, req_id)
            shared.waiters += 1
            try:
                return await asyncio.shield(shared.task)
            except asyncio.CancelledError:
                if not asyncio.current_task().cancelling():
                    continue  # not this waiter: the encode it joined was being cancelled; start another
                if shared.waiters == 1:
                    self._forget(key, shared)  # nobody else wants it: no one may join it now
                    shared.task.cancel()  # and stop the model work
                raise
            except Exception as exc:  # noqa: BLE001
                error = encode_error(exc, req_id, index)
                break
            finally:
                shared.waiters -= 1
        # The task's exception, raised here, holds this frame in its traceback: with the task
        # (in `shared`) and `error` still in it, that would be reference cycles, pinning the
        # item's input until a garbage collection.
        del shared
        try:
            raise error
        finally:
            del error

    def _shared(self, key: str, item: MediaInput, req_id: str) -> _Shared:
        """The encode of ``key`` in flight, joined, or a new one."""
        shared = self._inflight.get(key)
        if shared is not None:
            self.joined += 1
            return shared
        shared = self._inflight[key] = _Shared(asyncio.create_task(self._call(key, item.payload, req_id)))
        shared.task.add_done_callback(lambda _: self._forget(key, shared))
        return shared

    def _forget(self, key: str, shared: _Shared) -> None:
        if self._inflight.get(key) is shared:  # not a newer encode of the same key
            del self._inflight[key]

    def stats(self) -> dict[str, int]:
        return {
            **self.cache.stats(),
            **self._calls.stats(),
            "encodes_joined_total": self.joined,
            "item_encodes_in_flight": len(self._inflight),
        }

    async def _call(self, key: str, payload: Any, req_id: str) -> StagedItem:
        """The encode of ``key``, shared by every waiter (``req_id``: the first one's)."""
        ref, encoded = await self._calls.encode(key, payload, req_id)
        # A small item rides in each fetch's reply: a rank then needs no second call (to
        # this process, the owner) to read it. A large one is read from the object store,
        # zero-copy; keeping its value here would pin a mapping of it.
        small = encoded.meta["nbytes"] <= INLINE_MAX_BYTES
        item = StagedItem(meta=encoded.meta, ref=ref, value=encoded if small else None)
        if encoded.meta.get("mm_hash") == key:
            if self.cache.max_bytes > 0:
                self.cache.put(key, item)
        else:
            self._identity = None  # the model changed under us; do not cache under a stale key
        return item

    async def _deployment(self) -> Any:
        if self._handle is None:
            app, deployment = self._target
            # Building a handle talks to the Serve controller synchronously: off the loop.
            self._handle = await asyncio.to_thread(serve.get_deployment_handle, deployment, app, _check_exists=False)
        return self._handle

    async def _model_identity(self) -> str:
        """The serving model's identity, asked once for every item that needs it meanwhile
        (so the items of a request reach ``registry.server.batched_calls`` together)."""
        task = self._identity
        if task is None:
            task = self._identity = asyncio.create_task(self._ask_identity(), context=contextvars.Context())
        try:
            return await asyncio.shield(task)
        except Exception:
            if self._identity is task:
                self._identity = None  # asked again by the next item
            raise

    async def _ask_identity(self) -> str:
        handle = await self._deployment()
        return await handle.identity.remote()
