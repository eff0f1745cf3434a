"""The decoder side: a TP rank fetching its request's embeddings.

::

    rx = EmbeddingReceiver(rank=tp_rank)          # in each rank's process
    items = rx.fetch(req_id, timeout_s=30.0)      # or: await rx.fetch_async(...), and so on
    items[0].tensor, items[0].meta
    batch = rx.fetch_many([a, b, c])              # {req_id: items or its RegistryError}
    rx.acknowledge(other_req_id)                  # already held: count this rank, read nothing
    rx.acknowledge_many([d, e])                   # {req_id: released or its RegistryError}

A fetch is two steps: ask the registry (which waits until the request is staged,
records this rank, and hands back ObjectRefs), then read the objects. Reading is
zero-copy on the same node: ``.tensor`` views the object store's read-only
memory, bfloat16 included. Do not write to it in place (``.clone()`` first).
The tensor keeps the object alive for as long as it lives, even after the
registry released the entry.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import ray
from ray import exceptions as ray_exc

from encoder.types import EncodedItem
from registry.errors import NotReady, RegistryError, Unavailable, staged_lost, unwrap
from registry.client.received_item import ReceivedItem
from registry.client.shards import Shards
from registry.checks import check_rank
from registry.logs import get_logger
from registry.supervision import gather_within

logger = get_logger(__name__)

# Extra seconds on top of the registry's own timeout before giving up on the call.
_CALL_GRACE_S = 10.0


# What reading an object raises when its every copy is gone (its node died) or its
# owner, the registry, died (a restart).
_LOST = (ray_exc.ObjectLostError, ray_exc.OwnerDiedError)


def _translate(exc: BaseException, req_id: str) -> BaseException:
    exc = unwrap(exc)
    if isinstance(exc, RegistryError):
        return exc
    if isinstance(exc, _LOST):
        return staged_lost(req_id)
    if isinstance(exc, ray_exc.RayActorError):
        return Unavailable(f"the registry actor is not reachable ({type(exc).__name__}); retry shortly", req_id)
    if isinstance(exc, TimeoutError):  # ray.get's GetTimeoutError, or asyncio.wait_for's
        return NotReady(f"fetching req_id {req_id} timed out", req_id)
    return exc


async def read_pairs(pairs: list[tuple[dict[str, Any], Any]], timeout_s: float) -> list[tuple[dict[str, Any], EncodedItem]]:
    """A fetch's answer read: (meta, item) per item, in order. Small items came in the answer;
    the refs of large ones are read here, all within ``timeout_s`` (else ``TimeoutError``).
    Bounded because under load Ray has been seen (about one read in 3,000, several ranks of
    one process reading one entry) never to answer one."""
    refs = [held for _, held in pairs if isinstance(held, ray.ObjectRef)]
    values = iter(await gather_within(timeout_s, *refs))
    return [(meta, next(values) if isinstance(held, ray.ObjectRef) else held) for meta, held in pairs]


def _received(read: list[tuple[dict[str, Any], EncodedItem]]) -> list[ReceivedItem]:
    return [ReceivedItem(tensor=item.tensor(), meta=meta) for meta, item in read]


class EmbeddingReceiver:
    """Fetches staged embeddings for one TP rank.

    ``rank`` is this process's rank (0-based, below the request's
    ``receive_count``). ``registry_name``/``registry_namespace`` default to the
    app's defaults (or ``EPD_REGISTRY_NAME``/``EPD_REGISTRY_NAMESPACE``); ``shards``, the
    registry's actors as ``Shards.lookup`` found them, saves the first call looking them up.
    Errors are ``registry.errors.RegistryError`` subclasses with a ``.code``.

    Every call is written once, as a coroutine (``fetch_async`` and the other ``*_async``
    calls, for event loops: async actors, FastAPI handlers). The blocking calls run that
    coroutine on this process's receiver loop and wait for it; in an async actor they would
    block its loop, so use the ``*_async`` ones there.
    """

    def __init__(
        self, rank: int, *, registry_name: str | None = None, registry_namespace: str | None = None,
        shards: Shards | None = None,
    ):
        self.rank = check_rank(rank, ValueError)
        self._name = registry_name
        self._namespace = registry_namespace
        self._shards = shards

    # --- blocking -----------------------------------------------------------------

    def fetch(self, req_id: str, timeout_s: float = 30.0) -> list[ReceivedItem]:
        """Blocking ``fetch_async``."""
        return _blocking(self.fetch_async(req_id, timeout_s))

    def fetch_many(self, req_ids: list[str], timeout_s: float = 30.0) -> dict[str, list[ReceivedItem] | RegistryError]:
        """Blocking ``fetch_many_async``."""
        return _blocking(self.fetch_many_async(req_ids, timeout_s))

    def acknowledge(self, req_id: str, timeout_s: float = 0.0) -> bool:
        """Blocking ``acknowledge_async``."""
        return _blocking(self.acknowledge_async(req_id, timeout_s))

    def acknowledge_many(self, req_ids: list[str], timeout_s: float = 0.0) -> dict[str, bool | RegistryError]:
        """Blocking ``acknowledge_many_async``."""
        return _blocking(self.acknowledge_many_async(req_ids, timeout_s))

    # --- the rules ----------------------------------------------------------------

    async def fetch_async(self, req_id: str, timeout_s: float = 30.0) -> list[ReceivedItem]:
        """Wait up to ``timeout_s`` until ``req_id`` is staged, count this rank as one of its
        receivers, and read its items (zero-copy on the registry's node)."""
        bound = timeout_s + _CALL_GRACE_S
        try:
            pairs = await self._call(req_id, lambda shard: shard.fetch.remote(req_id, self.rank, timeout_s), bound)
            try:
                return _received(await read_pairs(pairs, bound))
            except _LOST:
                await self._report_lost(req_id)
                raise
        except Exception as exc:  # noqa: BLE001 - translated to the project's errors
            raise _translate(exc, req_id) from None

    async def fetch_many_async(
        self, req_ids: list[str], timeout_s: float = 30.0
    ) -> dict[str, list[ReceivedItem] | RegistryError]:
        """Fetch many requests at once as this rank (a decoder batch): one registry call per
        shard involved, each request by ``fetch_async``'s rules within ``timeout_s``.

        Returns ``{req_id: items}`` in the order given, where one request's failure is its
        ``RegistryError`` in place of its items; only a failure of the whole call raises.
        """
        bound = timeout_s + _CALL_GRACE_S
        try:
            out = await self._per_shard(req_ids, lambda shard, ids: shard.fetch_many.remote(ids, self.rank, timeout_s), bound)
        except Exception as exc:  # noqa: BLE001
            raise _translate(exc, None) from None
        staged = {req_id: pairs for req_id, pairs in out.items() if isinstance(pairs, list)}
        reads = await asyncio.gather(*(read_pairs(pairs, bound) for pairs in staged.values()), return_exceptions=True)
        for req_id, read in zip(staged, reads, strict=True):
            if isinstance(read, _LOST):
                await self._report_lost(req_id)
            out[req_id] = _translate(read, req_id) if isinstance(read, BaseException) else _received(read)
        return out

    async def acknowledge_async(self, req_id: str, timeout_s: float = 0.0) -> bool:
        """Count this rank as a receiver of ``req_id`` without reading its bytes.

        For a rank that already holds the items (its own cache hit): the entry is
        released after its last rank as if this one had fetched, instead of waiting
        for its ttl. Same rules and errors as ``fetch_async`` (``timeout_s`` waits while
        pending). Returns True if this released the entry.
        """
        bound = timeout_s + _CALL_GRACE_S
        try:
            answer = await self._call(req_id, lambda shard: shard.acknowledge.remote(req_id, self.rank, timeout_s), bound)
        except Exception as exc:  # noqa: BLE001
            raise _translate(exc, req_id) from None
        return answer["released"]

    async def acknowledge_many_async(self, req_ids: list[str], timeout_s: float = 0.0) -> dict[str, bool | RegistryError]:
        """``acknowledge_async`` of each req_id, with one registry call per shard involved.

        Returns ``{req_id: released}`` in the order given, where one request's failure is its
        ``RegistryError`` in its place; only a failure of the whole call raises.
        """
        bound = timeout_s + _CALL_GRACE_S
        try:
            out = await self._per_shard(
                req_ids, lambda shard, ids: shard.acknowledge_many.remote(ids, self.rank, timeout_s), bound
            )
        except Exception as exc:  # noqa: BLE001
            raise _translate(exc, None) from None
        return {req_id: answer if isinstance(answer, BaseException) else answer["released"] for req_id, answer in out.items()}

    # --- calls to the registry ------------------------------------------------------

    async def _shards_now(self) -> Shards:
        if self._shards is None:
            self._shards = await Shards.lookup_async(self._name, self._namespace)
        return self._shards

    async def _call(self, req_id: str, call: Callable[[Any], Any], bound: float) -> Any:
        """``call`` on the shard that holds ``req_id``, within ``bound``. A shard that died and
        was recreated under its name is a new actor: found again and asked once more (each
        call here is idempotent for a rank)."""
        for attempt in range(2):
            shards = await self._shards_now()
            try:
                return await asyncio.wait_for(call(shards.of(req_id)), bound)
            except ray_exc.ActorDiedError:
                if attempt:
                    raise
                self._shards = None
        raise AssertionError("unreachable")

    async def _per_shard(self, req_ids: list[str], call: Callable[[Any, list[str]], Any], bound: float) -> dict[str, Any]:
        """``call(shard, its req_ids)`` on every shard involved, at once: each distinct req_id, in
        order, to its answer or its ``RegistryError``. Shards that died and were recreated are
        asked once more, as in ``_call``."""
        order = list(dict.fromkeys(req_ids))
        out: dict[str, Any] = {}
        todo = order
        for attempt in range(2):
            shards = await self._shards_now()
            groups = shards.group(todo)
            waits = (asyncio.wait_for(call(shards.handles[i], ids), bound) for i, ids in groups.items())
            answers = await asyncio.gather(*waits, return_exceptions=True)
            todo = []
            for ids, answer in zip(groups.values(), answers, strict=True):
                if isinstance(answer, ray_exc.ActorDiedError) and attempt == 0:
                    todo += ids
                    continue
                for req_id in ids:
                    out[req_id] = answer[req_id] if isinstance(answer, dict) else _translate(answer, req_id)
            if not todo:
                break
            self._shards = None
        return {req_id: out[req_id] for req_id in order}

    async def _report_lost(self, req_id: str) -> None:
        """Tell the registry this request's objects are gone, so it ends the entry and the
        other ranks are told at once (it checks before believing it). Best effort: the
        caller raises the loss either way."""
        try:
            shards = await self._shards_now()
            await asyncio.wait_for(shards.of(req_id).report_lost.remote(req_id), _CALL_GRACE_S)
        except Exception as exc:  # noqa: BLE001 - e.g. the registry itself restarted: nothing to tell
            logger.info("req_id=%s: telling the registry its objects are lost failed (%s: %s)", req_id, type(exc).__name__, exc)


# The blocking calls' event loop: one per process, on a daemon thread, started on first use
# (and again in a forked child, which inherits the loop but not its thread).
_LOOP: tuple[int, asyncio.AbstractEventLoop] | None = None
_LOOP_LOCK = threading.Lock()


def _blocking(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on the receiver loop and wait for its outcome; if the wait is interrupted
    (KeyboardInterrupt), the call is cancelled rather than left running."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="epd-receiver-loop", daemon=True).start()
            _LOOP = (os.getpid(), loop)
        loop = _LOOP[1]
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result()
    except BaseException:
        future.cancel()
        raise
