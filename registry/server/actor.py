"""The registry actor: a thin async shell around ``RegistryState``.

One detached, named actor per app is the single source of truth for staged
embeddings. It adds to the state machine only what needs a process:

* it *calls the encoder deployment itself*, so the ObjectRefs of the results are
  owned by this actor (a handle call's result ref belongs to the caller) and the
  staged bytes outlive the replica that computed them;
* waiting (fetch before staging, ``wait`` on encode and describe) is an
  ``asyncio.Event`` per waiting call and ``req_id``, set on every change
  (``registry.server.changes.Changes``), never a polling loop;
* one timer task sleeps until the next deadline and expires entries.

It never blocks its event loop: everything is ``await``ed, and the one blocking
Serve call (building the handle) runs in a thread.

The decoder ranks' calls (fetch, peek, acknowledge, claim, endpoints, refuse, states, watch,
report_lost) are methods here, as Ray needs them, handing over to ``rank_calls.RankCalls``
(the same table, metrics, ``Changes`` and ``CallErrors``: where errors are counted and logged).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import os
import time
from collections import Counter as _Count
from typing import Any

import ray

from registry.errors import InvalidRequest, RegistryError, Unavailable
from registry.server.inputs import MediaInput
from registry.logs import configure_actor_logging, get_logger
from registry.server.call_errors import CallErrors
from registry.server.changes import Changes, check_wait, wait_up_to
from registry.server.metrics import RegistryMetrics
from registry.server.priority import set_niceness
from registry.server.rank_calls import RankCalls
from registry.settings import RegistrySettings
from registry.supervision import supervised
from registry.server.state import (
    LIVE_STATES, MAX_LIST_LIMIT, PENDING, RELEASED, STAGED, TERMINAL_STATES, Entry, Limits, RegistryState, StagedItem,
    ended_error,
)

logger = get_logger(__name__)

# Most requests one ``submit_many`` call may carry.
MAX_SUBMITS_PER_CALL = 1024
# Ray's metrics are scraped every few seconds; the table's gauges are published this often.
_METRICS_PERIOD_S = 0.5


def _effective_limits(settings: RegistrySettings) -> Limits:
    """The limits, with staged bytes also capped at a share of the cluster's object store
    (blocking: asks the GCS)."""
    store = ray.cluster_resources().get("object_store_memory", 0)
    cap = int(store * settings.max_object_store_fraction) if store else settings.limits.max_staged_bytes
    return dataclasses.replace(settings.limits, max_staged_bytes=min(settings.limits.max_staged_bytes, cap))


def _answer(entry: Entry) -> dict[str, Any]:
    """What a submit answers: the entry's description, or the error it ended with."""
    if entry.state in (PENDING, STAGED, RELEASED):
        return entry.describe()
    raise entry.error.fresh() if entry.error is not None else ended_error(entry)


class EmbeddingRegistry:
    """Actor class; create it with ``get_or_create_registry``. The calls of decoder ranks
    (fetch, acknowledge, states, watch, report_lost, ...) are answered by ``self._ranks``."""

    def __init__(self, settings: RegistrySettings):
        configure_actor_logging()
        set_niceness(settings.niceness)
        self._settings = settings
        self._state = RegistryState(_effective_limits(settings))
        self._metrics = RegistryMetrics(settings.name, settings.shard)
        # Given once: the shard and the shard count never change (``configure`` keeps them).
        self._errors = CallErrors(
            settings.name, settings.shard, settings.registry_shards, self._metrics, self._ensure_background_tasks
        )
        self._changes = Changes(self._on_change)
        self._submitters: _Count[str] = _Count()  # submit calls waiting, per req_id
        # submit and submit_many calls, and the requests they carried (stats and metrics).
        self._submits = {"submit_calls_total": 0, "submitted_requests_total": 0}
        self._encode_tasks: dict[str, asyncio.Task] = {}
        self._timer_wake = asyncio.Event()
        self._timer: asyncio.Task | None = None
        self._publisher: asyncio.Task | None = None
        self._metrics_stale = False
        # Imported here, not with the module: Ray loads this class, for its methods'
        # signatures, in every process that calls the registry, decoder ranks included, and
        # the encoder client brings Serve and FastAPI (0.6 CPU-s on a rank's first fetch).
        from registry.server.encodes import EncoderClient

        self._encoder = EncoderClient(settings)
        self._started_at = time.time()
        # After a crash Ray re-runs this constructor: the table and every object it owned are
        # gone. Requests staged before cannot be told from ones not sent yet, so for a while
        # a fetch of an unknown req_id waits only briefly, then says the entry was lost.
        self._ranks = RankCalls(
            self._state, self._metrics, self._changes, self._errors, ensure_running=self._ensure_background_tasks,
            started_at=self._started_at, restarted=ray.get_runtime_context().was_current_actor_reconstructed,
            restart_grace_s=settings.restart_grace_s,
        )

    # --- control ------------------------------------------------------------------

    async def configure(self, settings: RegistrySettings, after_loss: bool = False) -> None:
        """Apply the app's current settings (the actor may predate this deployment).

        ``after_loss``: this registry replaces one that died for good, so unknown req_ids
        are treated as after a restart (lost, told fast).
        """
        if after_loss:
            self._ranks.restarted = True
        # Which req_ids this shard holds is fixed at creation (``registry.server.create`` warns).
        settings = dataclasses.replace(settings, registry_shards=self._settings.registry_shards, shard=self._settings.shard)
        if settings.registry_max_concurrency != self._settings.registry_max_concurrency:
            logger.warning(
                "registry_max_concurrency is %d in the new config but this registry was created with %d; "
                "it takes effect only when the registry actor is created again",
                settings.registry_max_concurrency, self._settings.registry_max_concurrency,
            )
            settings = dataclasses.replace(settings, registry_max_concurrency=self._settings.registry_max_concurrency)
        self._encoder.reconfigure(settings)
        if settings.niceness != self._settings.niceness:
            set_niceness(settings.niceness)
        self._settings = settings
        self._ranks.restart_grace_s = settings.restart_grace_s
        self._state.limits = await asyncio.to_thread(_effective_limits, settings)
        self._timer_wake.set()

    async def configure_logging(self, level: int, encoding: str) -> None:
        """Log at ``level`` in ``encoding`` ("TEXT" or "JSON"): the app's ``logging_config``,
        as its Ingress replica got it from Serve."""
        configure_actor_logging(level, encoding)

    async def ping(self) -> dict[str, Any]:
        settings = self._settings
        return {"pid": os.getpid(), "started_at": self._started_at, "name": settings.name,
                "shard": settings.shard, "shards": settings.registry_shards}

    async def stats(self) -> dict[str, int]:
        stats = self._state.stats(time.time())
        stats["max_staged_bytes"] = self._state.limits.max_staged_bytes
        stats["waiting_calls"] = self._changes.waiting_calls
        stats["encodes_in_flight"] = len(self._encode_tasks)
        return {**stats, **self._submits, **self._encoder.stats()}

    # --- ingress ------------------------------------------------------------------

    async def submit(
        self, req_id: str, items: list[MediaInput], digest: str, receive_count: int | None, wait: bool
    ) -> dict[str, Any]:
        """Accept an encode (or join the live one with this req_id) and return its description.

        With ``wait`` it returns once the entry left ``pending``; a failed, cancelled
        or expired outcome raises that error. ``items`` are ``registry.media_input(bytes)``;
        ``receive_count`` None is the app's default, ``OPEN`` (0) what the ranks' ``claim``s fix."""
        self._count_submits(1)
        entry = self._accept(req_id, items, digest, receive_count)
        self._submitters[req_id] += 1
        try:
            while wait and entry.state == PENDING:
                await self._changes.wait(req_id, None)
        except asyncio.CancelledError:
            # The caller went away (client disconnected or timed out; the ingress cancels this
            # call). If no other caller waits for this request, nobody will use its result:
            # cancel it rather than stage an orphan, and ranks waiting for it are told so.
            if self._submitters[req_id] == 1 and entry.state == PENDING:  # pending: still the live one
                self._state.cancel(req_id, time.time())
                logger.info("req_id=%s cancelled: its client went away before it was staged", req_id)
                self._changes.changed(req_id)
            raise
        finally:
            self._submitters[req_id] -= 1
            if not self._submitters[req_id]:
                del self._submitters[req_id]
        return _answer(entry)

    async def submit_many(self, requests: list[tuple[str, list[MediaInput], str, int | None]]) -> list[Any]:
        """Accept several encodes at once, each as ``submit`` with ``wait=False`` would: one call
        for the ``(req_id, items, digest, receive_count)`` that reached an Ingress replica
        together. Returns, in order, each one's description or the ``RegistryError`` that
        refused it alone."""
        if not isinstance(requests, list) or len(requests) > MAX_SUBMITS_PER_CALL:
            raise InvalidRequest(f"submit_many takes a list of at most {MAX_SUBMITS_PER_CALL} requests")
        self._count_submits(len(requests))
        out: list[Any] = []
        for request in requests:
            try:
                if not isinstance(request, (list, tuple)) or len(request) != 4:
                    error = InvalidRequest("each request is (req_id, items, digest, receive_count)")
                    self._errors.count(error)
                    raise error
                out.append(_answer(self._accept(*request)))
            except RegistryError as exc:
                out.append(exc.fresh())
        return out

    def _count_submits(self, requests: int) -> None:
        self._submits["submit_calls_total"] += 1
        self._submits["submitted_requests_total"] += requests

    def _accept(self, req_id: str, items: list[MediaInput], digest: str, receive_count: int | None) -> Entry:
        """The entry for this request: created (its encode started) or the live one joined."""
        self._ensure_background_tasks()
        self._errors.check_owned(req_id)
        if not isinstance(items, list) or not all(isinstance(item, MediaInput) for item in items):
            error = InvalidRequest("submit takes a list of MediaInput; build each with registry.media_input(data)", req_id)
            self._errors.count(error)
            raise error
        count = self._settings.default_receive_count if receive_count is None else receive_count
        try:
            entry, created = self._state.accept(req_id, digest, count, time.time(), sum(item.nbytes for item in items))
        except RegistryError as exc:
            self._errors.count(exc)
            self._metrics.encode_requests.inc(tags={"result": "rejected"})
            raise
        self._metrics.encode_requests.inc(tags={"result": "accepted" if created else "duplicate"})
        logger.debug("req_id=%s %s: %d items, receive_count=%d", req_id, "accepted" if created else "joined", len(items), count)
        if created:
            # A fresh context: Ray files calls made in this call's context as its children, and
            # cancelling a call (a client gone) cancels its children too. The encode belongs to
            # the registry, shared by every caller of this req_id and of identical items; the
            # registry stops it when nobody wants it any more.
            self._encode_tasks[req_id] = asyncio.create_task(
                self._run_encode(entry, items), context=contextvars.Context()
            )
            self._changes.changed(req_id)
        return entry

    async def describe(self, req_id: str, wait_s: float = 0.0, wait_for_submit: bool = False) -> dict[str, Any]:
        """The entry's description; with ``wait_s`` wait up to that long while it is pending.
        A ``req_id`` never seen is ``unknown_request`` at once, unless ``wait_for_submit``."""
        self._errors.check_owned(req_id)
        deadline = time.monotonic() + check_wait(wait_s, "wait_s", req_id)
        while (remaining := deadline - time.monotonic()) > 0 and not self._decided(req_id):
            if not wait_for_submit and not self._state.knows(req_id, time.time()):
                break  # unknown_request, below
            await self._changes.wait(req_id, remaining)
        try:
            return self._state.get(req_id, time.time()).describe()  # unknown_request if never seen
        except RegistryError as exc:
            self._errors.count(exc)
            raise

    async def list_requests(self, state: str | None, after: str | None, limit: int) -> dict[str, Any]:
        """Entries and tombstones in ``req_id`` order after ``after`` (of ``state`` if given):
        ``{"requests": [description, ...], "more": bool}``, at most ``limit`` of them."""
        if state is not None and state not in (*LIVE_STATES, *TERMINAL_STATES):
            raise InvalidRequest(f"state must be one of {', '.join((*LIVE_STATES, *TERMINAL_STATES))}, got {state!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
            raise InvalidRequest(f"limit must be an integer between 1 and {MAX_LIST_LIMIT}, got {limit!r}")
        entries, more = self._state.list_entries(state, after, limit, time.time())
        return {"requests": [entry.describe() for entry in entries], "more": more}

    def _decided(self, req_id: str) -> bool:
        """Known and past pending (what ``describe`` waits for)."""
        try:
            return self._state.get(req_id, time.time()).state != PENDING
        except RegistryError:
            return False

    async def cancel(self, req_id: str) -> dict[str, Any]:
        """Cancel a pending or staged entry; an ended one is described unchanged."""
        self._errors.check_owned(req_id)
        live = self._state.is_live(req_id)
        try:
            entry = self._state.cancel(req_id, time.time())
        except RegistryError as exc:
            self._errors.count(exc)
            raise
        if live:
            logger.info("req_id=%s cancelled by its client", req_id)
        self._changes.changed(req_id)
        return entry.describe()

    # --- decoder ranks: ``RankCalls`` answers (its docstrings say how) ---------------

    async def fetch(self, req_id: str, rank: int, timeout_s: float, transport: str = "ray", wait_for_submit: bool = True) -> Any:
        return await self._ranks.fetch(req_id, rank, timeout_s, transport, wait_for_submit)

    async def peek(self, req_id: str, rank: int, timeout_s: float, wait_for_submit: bool = True) -> Any:
        return await self._ranks.peek(req_id, rank, timeout_s, wait_for_submit)

    async def fetch_many(self, req_ids: list[str], rank: int, timeout_s: float) -> dict[str, Any]:
        return await self._ranks.fetch_many(req_ids, rank, timeout_s)

    async def acknowledge(self, req_id: str, rank: int, timeout_s: float = 0.0, transport: str = "ray") -> dict[str, Any]:
        return await self._ranks.acknowledge(req_id, rank, timeout_s, transport)

    async def acknowledge_many(self, req_ids: list[str], rank: int, timeout_s: float = 0.0) -> dict[str, Any]:
        return await self._ranks.acknowledge_many(req_ids, rank, timeout_s)

    async def claim(self, req_id: str, endpoint: str, receive_count: int, wait_s: float) -> dict[str, Any]:
        return await self._ranks.claim(req_id, endpoint, receive_count, wait_s)

    async def endpoints(self, req_id: str, wait_s: float) -> dict[str, Any]:
        return await self._ranks.endpoints(req_id, wait_s)

    async def refuse(self, req_id: str, error: RegistryError) -> bool:
        return await self._ranks.refuse(req_id, error)

    async def states(self, req_ids: list[str]) -> dict[str, str]:
        return await self._ranks.states(req_ids)

    async def watch(self, known: dict[str, str | None], timeout_s: float) -> dict[str, str]:
        return await self._ranks.watch(known, timeout_s)

    async def report_lost(self, req_id: str) -> bool:
        return await self._ranks.report_lost(req_id)

    # --- encoding -----------------------------------------------------------------

    async def _run_encode(self, entry: Entry, items: list[MediaInput]) -> None:
        req_id = entry.req_id
        staged: list[StagedItem] = []
        error: RegistryError | None = None
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._encoder.encode(req_id, i, data)) for i, data in enumerate(items)]
            staged = [task.result() for task in tasks]
        # Python 3.11's TaskGroup raises from a frame that keeps the exception: a cycle whose
        # traceback pinned this frame's items until a collection. Dropped, it pins nothing.
        except asyncio.CancelledError as exc:
            exc.__traceback__ = None
            if asyncio.current_task().cancelling():
                return  # the entry was cancelled or expired; the item calls were cancelled too
            # An item's call was cancelled under it: the entry must not wait out encode_timeout_s.
            error = Unavailable(f"the encode of req_id {req_id} was cancelled under it; retry", req_id)
        except Exception as exc:  # noqa: BLE001 - every failure must end the entry
            exc.__traceback__ = None
            first = exc.exceptions[0] if isinstance(exc, ExceptionGroup) else exc
            error = first if isinstance(first, RegistryError) else Unavailable(
                f"the encoder deployment cannot be reached: {first}", req_id
            )
        finally:
            # Done before the state changes below, so _on_change never cancels this task.
            if self._encode_tasks.get(req_id) is asyncio.current_task():
                del self._encode_tasks[req_id]
        if error is not None:
            if self._state.fail(entry, error, time.time()):
                self._errors.count(error)
        elif self._state.stage(entry, staged, time.time()):
            self._metrics.encode_latency.observe(time.time() - entry.created_at)
            logger.debug("req_id=%s staged: %d bytes", req_id, entry.nbytes)
        else:
            self._metrics.late_results.inc()  # the refs in `staged` are dropped right here
        self._changes.changed(req_id)

    # --- waiting and time ---------------------------------------------------------

    def _on_change(self, req_id: str) -> None:
        """Something about ``req_id`` changed (its waiters are woken): its encode, the timer, the gauges."""
        encode_task = self._encode_tasks.get(req_id)
        if encode_task is not None and not self._state.is_live(req_id):
            encode_task.cancel()  # cancelled or expired while encoding: stop the model work
        self._timer_wake.set()
        self._metrics_stale = True

    def _ensure_background_tasks(self) -> None:
        if self._timer is None or self._timer.done():
            self._timer = supervised(self._expire_loop(), "the registry's expiry timer", self._ensure_background_tasks, logger)
        if self._publisher is None or self._publisher.done():
            self._publisher = supervised(self._publish_loop(), "the registry's metrics publisher", self._ensure_background_tasks, logger)

    async def _publish_loop(self) -> None:
        """The gauges and totals follow the table at most every ``_METRICS_PERIOD_S``:
        computing them on every change took about a tenth of the registry's CPU under load."""
        while True:
            await asyncio.sleep(_METRICS_PERIOD_S)
            self._metrics.flush()
            if self._metrics_stale:
                self._metrics_stale = False
                self._metrics.sync({**self._state.stats(time.time()), **self._encoder.stats(), **self._submits})

    async def _expire_loop(self) -> None:
        while True:
            deadline = self._state.next_deadline()
            await wait_up_to(self._timer_wake, None if deadline is None else max(0.0, deadline - time.time()))
            self._timer_wake.clear()
            for entry in self._state.expire_due(time.time()):
                self._log_expiry(entry)
                self._changes.changed(entry.req_id)
                self._timer_wake.clear()

    def _log_expiry(self, entry: Entry) -> None:
        if entry.state == RELEASED:  # its last ranks pulled it over HTTP and their grace ended
            logger.debug("req_id=%s released: ranks %s received it", entry.req_id, sorted(entry.received))
        elif entry.staged_at is None:
            logger.warning("req_id=%s expired pending: not encoded within encode_timeout_s", entry.req_id)
        else:
            missing = sorted(set(range(entry.receive_count)) - set(entry.received))
            logger.warning("req_id=%s expired staged: ranks %s had it, %s not within ttl_s", entry.req_id, sorted(entry.received), missing)
