"""Encode requests that reach an Ingress replica together go to their registry shard together.

A request with ``wait: false`` (the vLLM proxy's, a pipelined client's) is answered
as soon as the registry accepted it. Those that arrive in the same turn of the
replica's event loop and belong to the same shard are accepted in one
``submit_many`` call (of at most ``registry_call_max_requests``), so a busy replica
makes fewer and fuller registry calls and a quiet one sends each request alone,
with no wait added. That pays because the call
is the cost: a no-op actor call takes its caller and its callee each about 0.45 ms
of CPU here, where a call that carries 8 requests costs each side about 0.05 ms per
request (``benchmarks/registry_load.py`` measures the whole lifecycle).

A request that waits for staging keeps a call of its own: the call stays open
until the entry is staged, and cancelling it (the client went away) cancels the
request, which one call for several could not do for each.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from registry.errors import RegistryError, Unavailable
from registry.logs import get_logger

logger = get_logger("deployments.ingress")  # the Ingress's lines

# (req_id, items, digest, receive_count): what the registry's submit_many takes per request.
Submit = tuple[str, list[Any], str, "int | None"]


class SubmitBatcher:
    """Sends ``wait: false`` submits through ``call_shard(shard, method, *args, req_id=...)``,
    the Ingress's registry call, which raises ``RegistryError`` only."""

    def __init__(self, call_shard: Callable[..., Awaitable[Any]], max_requests: int):
        self._call_shard = call_shard
        self._max_requests = max_requests
        self._queues: dict[int, list[tuple[Submit, asyncio.Future]]] = {}
        self._scheduled = False
        # The calls on their way: the event loop holds tasks only weakly.
        self._calls: set[asyncio.Task] = set()

    async def submit(self, shard: int, request: Submit) -> dict[str, Any]:
        """The request's description once shard ``shard`` accepted it; raises its ``RegistryError``."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._queues.setdefault(shard, []).append((request, answer))
        if not self._scheduled:
            self._scheduled = True
            # A fresh context: the calls must not belong to the request that happened to be
            # first (Ray and Serve keep a request's identity, and its cancellation, in it).
            loop.call_soon(self._flush, context=contextvars.Context())
        # Cancelled (the client went away) before its call left: it is not sent at all.
        return await answer

    def _flush(self) -> None:
        self._scheduled = False
        queues, self._queues = self._queues, {}
        for shard, queued in queues.items():
            queued = [(request, answer) for request, answer in queued if not answer.done()]
            for start in range(0, len(queued), self._max_requests):
                batch = queued[start:start + self._max_requests]
                call = asyncio.create_task(self._one(shard, *batch[0]) if len(batch) == 1 else self._many(shard, batch))
                self._calls.add(call)
                call.add_done_callback(self._calls.discard)

    async def _one(self, shard: int, request: Submit, answer: asyncio.Future) -> None:
        req_id = request[0]
        with _settled([answer]):
            try:
                _settle(answer, await self._call_shard(shard, "submit", *request, False, req_id=req_id))
            except RegistryError as exc:
                _settle(answer, exc.fresh())

    async def _many(self, shard: int, batch: list[tuple[Submit, asyncio.Future]]) -> None:
        with _settled([answer for _, answer in batch]):
            try:
                answers = await self._call_shard(shard, "submit_many", [request for request, _ in batch])
            except RegistryError as exc:  # the call failed: so did every request in it
                answers = [exc.fresh(req_id=request[0]) for request, _ in batch]
            if not isinstance(answers, list) or len(answers) != len(batch):
                raise RuntimeError(f"submit_many answered {type(answers).__name__} for {len(batch)} requests")
            for (_, answer), value in zip(batch, answers, strict=True):
                _settle(answer, value)


@contextlib.contextmanager
def _settled(answers: list[asyncio.Future]) -> Iterator[None]:
    """Every caller gets an answer, whatever happens to the call: a bug's exception (logged
    once here, with its traceback) or, if the call is cancelled, ``unavailable``. A caller
    awaits its answer with no timeout of its own."""
    try:
        yield
    except asyncio.CancelledError:
        for answer in answers:
            _settle(answer, Unavailable("the Ingress replica stopped before the registry answered; retry"))
        raise
    except Exception as exc:  # noqa: BLE001 - not the registry's answer: a bug
        logger.error("a registry submit call failed unexpectedly", exc_info=exc)
        for answer in answers:
            _settle(answer, exc)


def _settle(answer: asyncio.Future, value: Any) -> None:
    if answer.done():  # its client went away meanwhile
        return
    if isinstance(value, BaseException):
        answer.set_exception(value)
    else:
        answer.set_result(value)
