"""Encoder calls that carry several items: what reaches the registry together goes together.

An item that the cache and the in-flight table could not answer waits here until
the current turn of the event loop ends; everything queued by then leaves in Serve
calls of at most ``max_items`` items. One item goes as ``Encoder.encode``; several
go as one ``Encoder.encode_many``, streamed, so each result still comes back as its
own object, owned by this process, the moment it is ready. A quiet registry thus
sends every item alone with no wait added; a busy one, whose loop turns each bring
several calls, sends fewer and fuller ones. That is what pays: the caller's side of
a Serve call (routing, the replica's accept protocol, the reply) costs the registry
more CPU than anything else it does for an item.

Serve counts a call, not its items, as one ongoing request, for the Encoder's
``max_ongoing_requests``, ``max_queued_requests`` and its default autoscaling
policy; ``deployments.autoscaling.scale_on_items`` scales on the items instead
(docs/operations.md, "Batched calls").

A replica that dies mid-call: the items it had not answered are sent once more,
since Serve retries only requests no replica accepted yet. An item whose waiters
all went away is dropped if not sent yet, and a call none of whose items is wanted
any more is cancelled.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import ray
from ray.exceptions import RayActorError

from registry.errors import unwrap
from registry.logs import get_logger

logger = get_logger(__name__)

# How many times an item is sent again when the replica encoding it dies. One: a
# second death in a row is more likely the input killing replicas than bad luck.
REPLICA_DEATH_RETRIES = 1


@dataclasses.dataclass(eq=False)
class _Item:
    key: str  # mm_hash, for log lines
    payload: Any
    req_id: str
    # (ref, value) of the result; cancelled when every waiter went away.
    answer: asyncio.Future
    call: asyncio.Task | None = None


class EncoderCalls:
    """Sends items to the Encoder deployment that ``deployment()`` returns a handle of."""

    def __init__(self, deployment: Callable[[], Awaitable[Any]], max_items: int):
        self.max_items = max_items
        self._deployment = deployment
        self._stream: tuple[Any, Any] | None = None  # (handle, the same with stream=True)
        self._queue: list[_Item] = []
        self._flush_scheduled = False
        self._calls: dict[asyncio.Task, list[_Item]] = {}
        self.calls = 0  # Encoder calls made, and the items they carried
        self.items = 0
        self.replica_retries = 0

    async def encode(self, key: str, payload: Any, req_id: str) -> tuple[ray.ObjectRef, Any]:
        """The result's ref and its value (an ``EncodedItem``); raises what the encode raised."""
        loop = asyncio.get_running_loop()
        item = _Item(key, payload, req_id, loop.create_future())
        self._queue.append(item)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        try:
            # Cancelling this await cancels the future too: the item is then dropped.
            return await item.answer
        except asyncio.CancelledError:
            call = item.call
            if call is not None and all(other.answer.done() for other in self._calls.get(call, ())):
                call.cancel()  # nobody wants any of its items: stop the model work
            raise
        finally:
            # The answer's exception, raised here, holds this frame: with the item (and its
            # answer) in it, a reference cycle that would pin the payload until a collection.
            del item

    def stats(self) -> dict[str, int]:
        return {"encoder_calls_total": self.calls, "encoder_call_items_total": self.items,
                "replica_retries_total": self.replica_retries}

    def _flush(self) -> None:
        self._flush_scheduled = False
        items = [item for item in self._queue if not item.answer.done()]
        self._queue.clear()
        for start in range(0, len(items), self.max_items):
            batch = items[start:start + self.max_items]
            # A fresh context: Ray would file the Encoder call as a child of whichever
            # registry call queued the first item, and cancel it with that call.
            call = asyncio.create_task(self._send(batch), context=contextvars.Context())
            self._calls[call] = batch
            call.add_done_callback(self._forget)
            for item in batch:
                item.call = call

    def _forget(self, call: asyncio.Task) -> None:
        for item in self._calls.pop(call, ()):
            # The call is over: nothing is left to cancel. Kept, the task would hold its
            # exception, whose traceback holds the call's frame, which holds this item: a
            # cycle pinning the item's payload until a collection.
            item.call = None
            if not item.answer.done():  # the call was cancelled (its items were not wanted)
                item.answer.cancel()

    async def _send(self, items: list[_Item]) -> None:
        for attempt in range(1 + REPLICA_DEATH_RETRIES):
            self.calls += 1
            self.items += len(items)
            answered = 0
            response = None
            try:
                response = await self._request(items)
                async for ref in _refs(response, len(items)):
                    try:
                        # Read once for its metadata. On the same node this maps the payload
                        # without copying it (the mapping is dropped on return); from another
                        # node it leaves a spare, evictable copy here, as Serve's router's own
                        # read of a unary result does anyway.
                        value = await ref
                    except RayActorError:
                        raise  # the replica died: the call's failure, retried below
                    except Exception as exc:  # noqa: BLE001 - this item's own failure
                        value = _bare(exc)
                    _resolve(items[answered], ref, value)
                    answered += 1
                if answered < len(items):
                    raise RuntimeError(f"the encoder answered {answered} of {len(items)} items")
                return
            except asyncio.CancelledError:
                if response is not None:
                    response.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - every item must be answered
                error = _bare(exc)
                rest = [item for item in items[answered:] if not item.answer.done()]
                if isinstance(error, RayActorError) and rest and attempt < REPLICA_DEATH_RETRIES:
                    # The replica died holding these items (killed mid-batch, its node lost).
                    # The router has marked it dead and picks another for the retry.
                    self.replica_retries += 1
                    logger.warning(
                        "req_id=%s: the encoder replica died while encoding %d items (mm_hash=%s, ...): %s; "
                        "sending them once more", rest[0].req_id, len(rest), rest[0].key, type(error).__name__,
                    )
                    items = rest
                    continue
                for item in rest:
                    _resolve(item, None, error)
                return

    async def _request(self, items: list[_Item]) -> Any:
        handle = await self._deployment()
        if len(items) == 1:
            # A top-level ref argument: Ray resolves it in the replica, not here.
            return handle.encode.remote(items[0].payload, items[0].req_id)
        if self._stream is None or self._stream[0] is not handle:
            self._stream = (handle, handle.options(stream=True))
        return self._stream[1].encode_many.remote([item.payload for item in items], [item.req_id for item in items])


async def _refs(response: Any, count: int) -> AsyncIterator[ray.ObjectRef]:
    """The refs of a call's results, in item order."""
    if count == 1:
        yield await response._to_object_ref()
        return
    async for ref in await response._to_object_ref_gen():
        yield ref


def _bare(exc: BaseException) -> BaseException:
    """``exc`` to hand to the items' waiters, without this frame: a future keeps its
    exception, whose traceback would pin the call's locals (the input refs among them)
    in a cycle only the garbage collector breaks."""
    error = unwrap(exc).with_traceback(None)
    error.__context__ = None
    return error


def _resolve(item: _Item, ref: ray.ObjectRef | None, value: Any) -> None:
    if item.answer.done():  # its waiters went away meanwhile: the result is dropped here
        return
    if isinstance(value, BaseException):
        item.answer.set_exception(value)
    else:
        item.answer.set_result((ref, value))
