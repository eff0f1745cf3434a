"""The decoder side: a TP rank fetching its request's embeddings.

::

    rx = EmbeddingReceiver(rank=tp_rank)          # in each rank's process
    items = rx.fetch(req_id, timeout_s=30.0)      # or: await rx.fetch_async(...)
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
from collections.abc import Generator
from typing import Any

import ray
from ray import exceptions as ray_exc

from encoder.types import EncodedItem
from registry.errors import NotReady, RegistryError, Unavailable, staged_lost, unwrap
from registry.client.received_item import ReceivedItem
from registry.client.shards import Shards
from registry.supervision import gather_within

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


def _get_or_error(refs: Any, timeout_s: float) -> Any:
    try:
        return ray.get(refs, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - one request's failure is its answer
        return exc


async def _read_within(refs: Any, timeout_s: float) -> Any:
    """The value of a ref, or the values of a list of refs, within ``timeout_s``."""
    if isinstance(refs, list):
        return await gather_within(timeout_s, *refs)
    return await asyncio.wait_for(refs, timeout_s)


def _refs(pairs: list[tuple[dict[str, Any], Any]]) -> list[ray.ObjectRef]:
    """What is left to read of a fetch's answer: small items came in it, large ones as refs."""
    return [held for _, held in pairs if isinstance(held, ray.ObjectRef)]


def _items(pairs: list[tuple[dict[str, Any], Any]], read: list[EncodedItem]) -> list[ReceivedItem]:
    """The received items, in order: each pair's item, or the value read for its ref."""
    values = iter(read)
    return [
        ReceivedItem(tensor=(next(values) if isinstance(held, ray.ObjectRef) else held).tensor(), meta=meta)
        for meta, held in pairs
    ]


class EmbeddingReceiver:
    """Fetches staged embeddings for one TP rank.

    ``rank`` is this process's rank (0-based, below the request's
    ``receive_count``). ``registry_name``/``registry_namespace`` default to the
    app's defaults (or ``EPD_REGISTRY_NAME``/``EPD_REGISTRY_NAMESPACE``).
    Errors are ``registry.errors.RegistryError`` subclasses with a ``.code``.
    """

    def __init__(self, rank: int, *, registry_name: str | None = None, registry_namespace: str | None = None):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
        self.rank = rank
        self._name = registry_name
        self._namespace = registry_namespace
        self._shards: Shards | None = None

    def _lookup(self) -> Shards:
        if self._shards is None:
            self._shards = Shards.lookup(self._name, self._namespace)
        return self._shards

    async def _lookup_async(self) -> Shards:
        if self._shards is None:
            self._shards = await Shards.lookup_async(self._name, self._namespace)
        return self._shards

    def _handle(self, req_id: str) -> ray.actor.ActorHandle:
        return self._lookup().of(req_id)

    # One set of rules for both APIs: ``_fetch_steps`` says what to wait for, in order, and
    # what to do with each answer; ``fetch`` and ``fetch_async`` only carry the steps out,
    # blocking or awaiting, each wait bounded by ``timeout_s`` + ``_CALL_GRACE_S``.

    def _fetch_steps(self, req_id: str, timeout_s: float) -> Generator[tuple[str, Any], Any, list[ReceivedItem]]:
        shards = yield ("shards", None)
        try:
            pairs = yield ("get", shards.of(req_id).fetch.remote(req_id, self.rank, timeout_s))
        except ray_exc.ActorDiedError:
            # A registry recreated under the same name is a new actor: find it and ask once more
            # (a fetch is idempotent for a rank).
            self._shards = None
            shards = yield ("shards", None)
            pairs = yield ("get", shards.of(req_id).fetch.remote(req_id, self.rank, timeout_s))
        refs = _refs(pairs)
        try:
            values = (yield ("get", refs)) if refs else []
        except _LOST:
            yield ("report_lost", req_id)
            raise
        return _items(pairs, values)

    def _fetch_many_steps(
        self, req_ids: list[str], timeout_s: float
    ) -> Generator[tuple[str, Any], Any, dict[str, list[ReceivedItem] | RegistryError]]:
        out: dict[str, Any] = {}
        todo = list(dict.fromkeys(req_ids))
        order = list(todo)
        for attempt in range(2):  # once more for shards that died and were recreated, as in fetch
            shards = yield ("shards", None)
            groups = shards.group(todo)
            calls = [shards.handles[i].fetch_many.remote(ids, self.rank, timeout_s) for i, ids in groups.items()]
            answers = yield ("gather", calls)
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
        staged = {req_id: pairs for req_id, pairs in out.items() if isinstance(pairs, list)}
        values = yield ("gather", [_refs(pairs) for pairs in staged.values()])
        for (req_id, pairs), value in zip(staged.items(), values, strict=True):
            if isinstance(value, _LOST):
                yield ("report_lost", req_id)
            out[req_id] = _translate(value, req_id) if isinstance(value, BaseException) else _items(pairs, value)
        return {req_id: out[req_id] for req_id in order}

    def fetch(self, req_id: str, timeout_s: float = 30.0) -> list[ReceivedItem]:
        """Blocking fetch. In an async actor use ``fetch_async`` (this would block its loop)."""
        return self._run(self._fetch_steps(req_id, timeout_s), timeout_s, req_id)

    async def fetch_async(self, req_id: str, timeout_s: float = 30.0) -> list[ReceivedItem]:
        """``fetch`` for event loops (async actors, FastAPI handlers): the same rules, awaited."""
        return await self._run_async(self._fetch_steps(req_id, timeout_s), timeout_s, req_id)

    def fetch_many(self, req_ids: list[str], timeout_s: float = 30.0) -> dict[str, list[ReceivedItem] | RegistryError]:
        """Fetch many requests at once as this rank (a decoder batch): one registry call per
        shard involved, each request by ``fetch``'s rules within ``timeout_s``.

        Returns ``{req_id: items}`` in the order given, where one request's failure is its
        ``RegistryError`` in place of its items; only a failure of the whole call raises.
        """
        return self._run(self._fetch_many_steps(req_ids, timeout_s), timeout_s, None)

    async def fetch_many_async(
        self, req_ids: list[str], timeout_s: float = 30.0
    ) -> dict[str, list[ReceivedItem] | RegistryError]:
        """``fetch_many`` for event loops: the same rules, awaited."""
        return await self._run_async(self._fetch_many_steps(req_ids, timeout_s), timeout_s, None)

    # The drivers: "shards" looks the registry up, "get" reads a ref (or a list of refs, all
    # or nothing), "gather" reads each of several refs or lists, each to its value or its
    # exception, and "report_lost" tells the registry. Each wait is bounded.

    def _run(self, steps: Generator[tuple[str, Any], Any, Any], timeout_s: float, req_id: str | None) -> Any:
        answer, error = None, None
        bound = timeout_s + _CALL_GRACE_S
        try:
            while True:
                kind, what = steps.throw(error) if error is not None else steps.send(answer)
                answer = error = None
                try:
                    if kind == "shards":
                        answer = self._lookup()
                    elif kind == "get":
                        answer = ray.get(what, timeout=bound)
                    elif kind == "gather":
                        answer = [_get_or_error(refs, bound) for refs in what]
                    else:
                        self._report_lost(what)
                except Exception as exc:  # noqa: BLE001 - handed to the rules, which decide
                    error = exc
        except StopIteration as done:
            return done.value
        except Exception as exc:  # noqa: BLE001 - translated to the project's errors
            raise _translate(exc, req_id) from None

    async def _run_async(self, steps: Generator[tuple[str, Any], Any, Any], timeout_s: float, req_id: str | None) -> Any:
        answer, error = None, None
        bound = timeout_s + _CALL_GRACE_S
        try:
            while True:
                kind, what = steps.throw(error) if error is not None else steps.send(answer)
                answer = error = None
                try:
                    if kind == "shards":
                        answer = await self._lookup_async()
                    elif kind == "get":
                        # Bounded as in ``fetch``: under load Ray has been seen (about one read in
                        # 3,000, several ranks of one process reading one entry) never to answer one.
                        answer = await _read_within(what, bound)
                    elif kind == "gather":
                        waits = (_read_within(refs, bound) for refs in what)
                        answer = await asyncio.gather(*waits, return_exceptions=True)
                    else:
                        await self._report_lost_async(what)
                except TimeoutError:
                    error = NotReady(f"fetching req_id {req_id} timed out", req_id)
                except Exception as exc:  # noqa: BLE001 - handed to the rules, which decide
                    error = exc
        except StopIteration as done:
            return done.value
        except Exception as exc:  # noqa: BLE001
            raise _translate(exc, req_id) from None

    def acknowledge(self, req_id: str, timeout_s: float = 0.0) -> bool:
        """Count this rank as a receiver of ``req_id`` without reading its bytes.

        For a rank that already holds the items (its own cache hit): the entry is
        released after its last rank as if this one had fetched, instead of waiting
        for its ttl. Same rules and errors as ``fetch`` (``timeout_s`` waits while
        pending). Returns True if this released the entry.
        """
        try:
            call = self._handle(req_id).acknowledge.remote(req_id, self.rank, timeout_s)
            return ray.get(call, timeout=timeout_s + _CALL_GRACE_S)["released"]
        except Exception as exc:  # noqa: BLE001
            raise _translate(exc, req_id) from None

    def acknowledge_many(self, req_ids: list[str], timeout_s: float = 0.0) -> dict[str, bool | RegistryError]:
        """``acknowledge`` of each req_id, with one registry call per shard involved.

        Returns ``{req_id: released}`` in the order given, where one request's failure is its
        ``RegistryError`` in its place; only a failure of the whole call raises.
        """
        order = list(dict.fromkeys(req_ids))
        try:
            shards = self._lookup()
            groups = shards.group(order)
            calls = [shards.handles[i].acknowledge_many.remote(ids, self.rank, timeout_s) for i, ids in groups.items()]
            answers = [_get_or_error(call, timeout_s + _CALL_GRACE_S) for call in calls]
        except Exception as exc:  # noqa: BLE001
            raise _translate(exc, None) from None
        out: dict[str, Any] = {}
        for ids, answer in zip(groups.values(), answers, strict=True):
            for req_id in ids:
                result = answer[req_id] if isinstance(answer, dict) else _translate(answer, req_id)
                out[req_id] = result if isinstance(result, BaseException) else result["released"]
        return {req_id: out[req_id] for req_id in order}

    def _report_lost(self, req_id: str) -> None:
        """Tell the registry this request's objects are gone, so it ends the entry and the
        other ranks are told at once (it checks before believing it). Best effort: the
        caller raises the loss either way."""
        try:
            ray.get(self._handle(req_id).report_lost.remote(req_id), timeout=_CALL_GRACE_S)
        except Exception:  # noqa: BLE001 - e.g. the registry itself restarted: nothing to tell
            pass

    async def _report_lost_async(self, req_id: str) -> None:
        """``_report_lost``, awaited."""
        try:
            shards = await self._lookup_async()
            await asyncio.wait_for(shards.of(req_id).report_lost.remote(req_id), _CALL_GRACE_S)
        except Exception:  # noqa: BLE001 - as in _report_lost
            pass
