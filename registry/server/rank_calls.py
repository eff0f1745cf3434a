"""The registry actor's calls for decoder ranks: fetch (one or many), peek and acknowledge
(a push outside Ray; one or many), ``claim`` and ``endpoints`` (ranks known by their endpoint, as
SGLang's run), the batched ``states`` query and the ``watch`` long poll, and
``report_lost``.

``RankCalls`` answers them for ``registry.server.actor.EmbeddingRegistry``, whose methods
of the same names hand over to it. They are kept apart because they are the decoder's
side of the lifecycle: they count ranks and release entries, where the rest of the
actor accepts, encodes and expires them. ``RankCalls`` is given the actor's
``RegistryState``, its metrics, its ``Changes`` (waiting and waking) and its
``CallErrors`` (the shard check and error count every call shares), and owns what only
the ranks use: the pushes awaiting acknowledgement, and the restart facts that tell a
req_id lost in a crash from one not sent yet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import ray

from registry.errors import InvalidRequest, NotReady, RegistryError, Unavailable, UnknownRequest, staged_lost
from registry.logs import get_logger
from registry.server.call_errors import CallErrors
from registry.server.changes import Changes, check_wait, wait_up_to
from registry.server.metrics import RegistryMetrics
from registry.server.state import LIVE_STATES, OPEN, STAGED, FetchResult, RegistryState, StagedItem, ended_error

logger = get_logger("registry.server.actor")  # the actor's own lines: one logger for the whole registry

# Most req_ids one ``states``, ``watch`` or ``fetch_many`` call may name.
MAX_IDS_PER_CALL = 100_000
# How a rank received an entry, as its fetch metrics say: its own Ray call, a ZMQ push it
# acknowledged, or the Ingress's HTTP pull route.
TRANSPORTS = ("ray", "zmq", "http")
# Push registrations remembered for their latency before unacknowledged ones of ended
# entries are forgotten.
_MAX_PUSHES_HELD = 10_000
# How long report_lost tries to read an object before calling it unreadable (not lost).
_LOSS_CHECK_TIMEOUT_S = 10.0


def _checked_ids(req_ids: Any, name: str) -> Any:
    if not isinstance(req_ids, (list, dict)) or len(req_ids) > MAX_IDS_PER_CALL or not all(
        isinstance(req_id, str) for req_id in req_ids
    ):
        raise InvalidRequest(f"{name} must be a list (or dict) of at most {MAX_IDS_PER_CALL} req_id strings", None)
    return req_ids


def _checked_transport(transport: Any, req_id: str | None) -> str:
    if transport not in TRANSPORTS:
        raise InvalidRequest(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}", req_id)
    return transport


def _pairs(items: list[StagedItem]) -> list[tuple[dict[str, Any], Any]]:
    """A fetch's answer: (meta, ref) per item, or (meta, item) for one small enough to ride in it."""
    return [(item.meta, item.ref if item.value is None else item.value) for item in items]


async def _any_lost(items: list[StagedItem]) -> bool:
    """Whether reading ``items`` here finds one gone (a slow or otherwise failing read
    proves nothing: False)."""
    try:
        for item in items:
            await asyncio.wait_for(item.ref, _LOSS_CHECK_TIMEOUT_S)
    except ray.exceptions.ObjectLostError:  # OwnerDiedError and reconstruction failures included
        return True
    except Exception:  # noqa: BLE001
        return False
    return False


class RankCalls:
    """The decoder ranks' calls on one registry.

    ``ensure_running()`` starts the actor's background tasks (its publisher hands the
    fetch metrics counted here to Ray). ``started_at`` and ``restarted`` say when this
    registry started and whether it replaces one whose entries were lost (Ray re-created
    it after a crash); the actor's ``configure`` sets ``restarted`` (``after_loss``) and
    ``restart_grace_s``.
    """

    def __init__(
        self,
        state: RegistryState,
        metrics: RegistryMetrics,
        changes: Changes,
        errors: CallErrors,
        *,
        ensure_running: Callable[[], None],
        started_at: float,
        restarted: bool,
        restart_grace_s: float,
    ):
        self._state = state
        self._metrics = metrics
        self._changes = changes
        self._errors = errors
        self._ensure_running = ensure_running
        self._started_at = started_at
        self.restarted = restarted
        self.restart_grace_s = restart_grace_s
        self._pushes: dict[tuple[str, int], float] = {}  # (req_id, rank) pushed -> when, until acknowledged

    async def fetch(
        self, req_id: str, rank: int, timeout_s: float, transport: str = "ray", wait_for_submit: bool = True
    ) -> list[tuple[dict[str, Any], ray.ObjectRef]]:
        """Wait until ``req_id`` is staged, count ``rank`` as a receiver, return (meta, ref) per
        item, where a small item (up to ``registry.server.inputs.INLINE_MAX_BYTES``) comes as its
        ``EncodedItem`` in place of the ref. A ``req_id`` never seen is waited for too (a rank's
        fetch races its encode), unless not ``wait_for_submit``: then it is ``unknown_request``.

        The caller becomes a borrower of the refs, so it keeps the bytes alive after
        the registry released them. ``transport``: ``ray`` for a rank's own call, counted
        at once (the refs are in the reply it waits for); ``http`` for the Ingress's pull
        route, whose client may not get the bytes: the rank is counted at its
        acknowledgement or ``http_pull_grace_s`` after its last pull (``RegistryState.deliver``).
        """
        transport = _checked_transport(transport, req_id)
        result = await self._receive(req_id, rank, timeout_s, transport, deliver=transport == "http",
                                     wait_for_submit=wait_for_submit)
        return _pairs(result.items)

    async def peek(
        self, req_id: str, rank: int, timeout_s: float, wait_for_submit: bool = True
    ) -> list[tuple[dict[str, Any], ray.ObjectRef]]:
        """``fetch`` without counting ``rank``: what the Ingress pushes to a rank outside Ray
        (ZMQ), which is counted only when its receiver acknowledges receipt
        (``acknowledge(..., transport="zmq")``), so a push that is lost never counts."""
        started = time.monotonic()  # the rank's fetch latency runs from its first registration
        result = await self._receive(req_id, rank, timeout_s, "zmq", count=False, wait_for_submit=wait_for_submit)
        # Remembered only once the rank and the entry checked out: a staged entry, a valid rank.
        self._pushes.setdefault((req_id, rank), started)
        if len(self._pushes) > _MAX_PUSHES_HELD:  # registrations never acknowledged: forget the dead ones
            self._pushes = {key: t for key, t in self._pushes.items() if self._state.is_live(key[0])}
        return _pairs(result.items)

    async def fetch_many(
        self, req_ids: list[str], rank: int, timeout_s: float
    ) -> dict[str, list[tuple[dict[str, Any], ray.ObjectRef]] | RegistryError]:
        """``fetch`` of each req_id at once, as ``rank``, for a decoder batch: per req_id its
        (meta, ref) pairs or its error, each by ``fetch``'s rules, all within ``timeout_s``."""
        return await self._each(req_ids, timeout_s, lambda req_id: self.fetch(req_id, rank, timeout_s))

    async def acknowledge_many(
        self, req_ids: list[str], rank: int, timeout_s: float = 0.0
    ) -> dict[str, dict[str, Any] | RegistryError]:
        """``acknowledge`` of each req_id at once, as ``rank`` (a decoder step whose cache held
        several items): per req_id ``acknowledge``'s answer or its error."""
        return await self._each(req_ids, timeout_s, lambda req_id: self.acknowledge(req_id, rank, timeout_s))

    async def _each(self, req_ids: list[str], timeout_s: float, call: Any) -> dict[str, Any]:
        """``call`` for each distinct req_id, concurrently: req_id -> its answer or RegistryError."""
        self._errors.check_owned(*_checked_ids(req_ids, "req_ids"))
        check_wait(timeout_s, "timeout_s", None)
        unique = list(dict.fromkeys(req_ids))
        results = await asyncio.gather(*(call(req_id) for req_id in unique), return_exceptions=True)
        answer: dict[str, Any] = {}
        for req_id, result in zip(unique, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, RegistryError):
                raise result  # not an answer about this req_id (a cancelled call): the caller's to see
            answer[req_id] = result
        return answer

    async def acknowledge(self, req_id: str, rank: int, timeout_s: float = 0.0, transport: str = "ray") -> dict[str, Any]:
        """Count ``rank`` as a receiver without handing it the items: for a rank that
        already holds them (a decoder's own cache, or a ZMQ push it received: ``transport``
        ``zmq``), so the entry is not kept until its ttl waiting for a fetch that will never
        come. Same rules and errors as ``fetch``. Returns ``{"req_id", "rank", "released"}``.
        """
        transport = _checked_transport(transport, req_id)
        pushed_at = self._pushes.pop((req_id, rank), None) if transport == "zmq" else None
        result = await self._receive(req_id, rank, timeout_s, transport, started=pushed_at)
        return {"req_id": req_id, "rank": rank, "released": result.released}

    async def claim(self, req_id: str, endpoint: str, receive_count: int, wait_s: float) -> dict[str, Any]:
        """Register ``endpoint`` as one of ``req_id``'s ``receive_count`` ranks (SGLang's
        ``/scheduler_receive_url``): the first claim fixes the count of an entry accepted
        with it ``OPEN``; a repeated claim gets the same rank. Waits up to ``wait_s`` while
        ``req_id`` is unknown (a rank may register before its encode arrives); an ended
        entry's error is raised at once. Returns ``{"req_id", "rank", "receive_count"}``.
        """
        self._errors.check_owned(req_id)
        if not isinstance(endpoint, str) or not endpoint:
            raise InvalidRequest(f"endpoint must be a non-empty string, got {endpoint!r}", req_id)
        deadline = time.monotonic() + check_wait(wait_s, "wait_s", req_id)
        while True:
            try:
                rank = self._state.claim(req_id, endpoint, receive_count, time.time())
            except RegistryError as exc:
                self._errors.count(exc)
                raise
            if rank is not None:
                self._changes.changed(req_id)  # the encode waiting for its ranks' endpoints
                return {"req_id": req_id, "rank": rank, "receive_count": receive_count}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                error = NotReady(f"req_id {req_id} did not reach the encoder within {wait_s}s of its rank registering", req_id)
                self._errors.count(error)
                raise error
            await self._changes.wait(req_id, remaining)

    async def endpoints(self, req_id: str, wait_s: float) -> dict[str, Any]:
        """Wait up to ``wait_s`` until ``req_id`` can be delivered to ranks known by endpoint
        (staged, and every rank claimed its endpoint) or it ended. Returns ``{"state",
        "receive_count", "endpoints": {endpoint: rank}, "items", "error"}``: ``items`` the
        (meta, ref) pairs of a deliverable entry, as ``peek`` gives them (no rank counted);
        ``error`` what an ended entry's ranks are told. ``not_ready`` if it is neither by
        then; ``unknown_request`` if ``req_id`` is not known."""
        self._errors.check_owned(req_id)
        deadline = time.monotonic() + check_wait(wait_s, "wait_s", req_id)
        while True:
            try:
                entry = self._state.get(req_id, time.time())
            except RegistryError as exc:
                self._errors.count(exc)
                raise
            claimed = entry.receive_count != OPEN and len(entry.endpoints) == entry.receive_count
            if (claimed and entry.state == STAGED) or entry.state not in LIVE_STATES:
                ended = entry.state not in LIVE_STATES
                return {"state": entry.state, "receive_count": entry.receive_count, "endpoints": dict(entry.endpoints),
                        "items": None if ended else _pairs(entry.items or []),
                        "error": ended_error(entry) if ended else None}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                error = NotReady(
                    f"req_id {req_id} is {entry.state} with {len(entry.endpoints)} of its "
                    f"{entry.receive_count or 'unknown number of'} ranks registered after {wait_s}s",
                    req_id,
                )
                self._errors.count(error)
                raise error
            await self._changes.wait(req_id, remaining)

    async def refuse(self, req_id: str, error: RegistryError) -> bool:
        """Record that ``req_id`` was refused before the registry accepted it (bad media, say),
        so ranks waiting for it get ``error`` instead of waiting out their timeout. False
        when the registry knows ``req_id`` already: its own record stands."""
        self._errors.check_owned(req_id)
        if not isinstance(error, RegistryError):
            raise InvalidRequest("refuse takes the RegistryError the request was refused with", req_id)
        refused = self._state.refuse(req_id, error, time.time())
        if refused:
            self._changes.changed(req_id)
        return refused

    async def states(self, req_ids: list[str]) -> dict[str, str]:
        """The state of each req_id (an entry's, a tombstone's, or ``"unknown"``), in one call."""
        self._errors.check_owned(*_checked_ids(req_ids, "req_ids"))
        now = time.time()
        return {req_id: self._state.state_of(req_id, now) for req_id in req_ids}

    async def watch(self, known: dict[str, str | None], timeout_s: float) -> dict[str, str]:
        """The req_ids whose state differs from ``known`` (``None``: not known to the caller),
        with their states: at once if any differs, else as soon as one changes, else ``{}``
        after ``timeout_s``. A long poll: a scheduler keeps one in flight to keep a local
        view of many entries current without asking per entry.
        """
        self._errors.check_owned(*_checked_ids(known, "known"))
        deadline = time.monotonic() + check_wait(timeout_s, "timeout_s", None)
        with self._changes.watching(known) as wake:
            while True:
                now = time.time()
                changed = {
                    req_id: state for req_id, was in known.items() if (state := self._state.state_of(req_id, now)) != was
                }
                remaining = deadline - time.monotonic()
                if changed or remaining <= 0:
                    return changed
                wake.clear()
                await wait_up_to(wake, remaining)

    async def _receive(
        self, req_id: str, rank: int, timeout_s: float, transport: str, count: bool = True, started: float | None = None,
        deliver: bool = False, wait_for_submit: bool = True,
    ) -> FetchResult:
        """Wait until ``req_id`` is staged and count ``rank`` as a receiver (``fetch``,
        ``acknowledge``; ``peek`` with ``count=False``; an HTTP pull with ``deliver``, counted
        later). ``started``: when the fetch began, for its latency, if before this call. Not
        ``wait_for_submit``: a ``req_id`` never seen is ``unknown_request`` at once."""
        self._ensure_running()  # its counts are published by the actor's background tasks
        self._errors.check_owned(req_id)
        now = time.monotonic()
        deadline = now + check_wait(timeout_s, "timeout_s", req_id)
        started = now if started is None else started
        while True:
            try:
                if deliver:
                    result = self._state.deliver(req_id, rank, time.time())
                else:
                    result = self._state.fetch(req_id, rank, time.time(), count)
            except RegistryError as exc:
                self._count_fetch(exc.code, transport, started, count)
                self._errors.count(exc)
                raise
            if result is not None:
                self._count_fetch("released" if result.released else "ok", transport, started, count)
                if deliver:
                    logger.debug("req_id=%s rank %d pulled it over http; counted at its acknowledgement or grace end", req_id, rank)
                    self._changes.changed(req_id)  # its grace may now be the next deadline: the timer looks again
                elif count:
                    how = "" if transport == "ray" else f" over {transport}"
                    logger.debug("req_id=%s rank %d received it%s%s", req_id, rank, how, "; released" if result.released else "")
                if result.released:
                    self._changes.changed(req_id)
                return result
            remaining = deadline - time.monotonic()
            lost_by = self._lost_deadline(req_id, now)
            if not wait_for_submit and not self._state.knows(req_id, time.time()):
                error = UnknownRequest(f"no request with req_id {req_id} is known (or its record has aged out); "
                                       "to wait for one on its way, ask with wait_for_submit", req_id)
            elif lost_by is not None and time.monotonic() >= lost_by:
                error = Unavailable(
                    f"the registry restarted at {self._started_at:.3f} and lost the entries it held; "
                    f"req_id {req_id} is unknown to it: if it was encoded before then, encode it again",
                    req_id,
                    {"registry_started_at": self._started_at},
                )
            elif remaining <= 0:
                error = NotReady(f"req_id {req_id} was not staged within {timeout_s}s", req_id)
            else:
                await self._changes.wait(req_id, remaining if lost_by is None else min(remaining, lost_by - time.monotonic()))
                continue
            self._count_fetch(error.code, transport, started, count)
            self._errors.count(error)
            raise error

    def _count_fetch(self, result: str, transport: str, started: float, counted: bool) -> None:
        """A fetch's metrics: its result, and its latency once it ended (a push's ends at its
        acknowledgement; its refusals are results, counted at once)."""
        if counted or result not in ("ok", "released"):
            self._metrics.fetches.inc(tags={"result": result, "transport": transport})
        if counted:
            self._metrics.fetch_latency.observe(time.monotonic() - started, {"transport": transport})

    def _lost_deadline(self, req_id: str, fetch_started: float) -> float | None:
        """When a fetch of ``req_id`` begun at ``fetch_started`` should give up as lost:
        ``restart_grace_s`` later, but only after a restart, only for a req_id the registry
        does not know, and only while entries from before the restart could still have
        been alive (their ttl or encode timeout)."""
        if not self.restarted or self._state.is_live(req_id):
            return None
        limits = self._state.limits
        if time.time() > self._started_at + max(limits.ttl_s, limits.encode_timeout_s):
            return None
        try:
            self._state.get(req_id, time.time())
            return None  # it ended after the restart: the tombstone answers
        except RegistryError:
            pass
        return fetch_started + self.restart_grace_s

    async def report_lost(self, req_id: str) -> bool:
        """A rank could not read ``req_id``'s objects: if they are really gone (a node died),
        end the entry ``failed`` with ``unavailable`` so every other rank is told at once.

        Checked by reading them here, the owner: a rank's own trouble must not end an
        entry other ranks can still fetch. True if the entry was ended.
        """
        self._errors.check_owned(req_id)
        try:
            entry = self._state.get(req_id, time.time())
        except RegistryError:
            return False
        if entry.state != STAGED or entry.items is None or not await _any_lost(entry.items):
            return False
        error = staged_lost(req_id)
        if not self._state.lose(req_id, error, time.time()):
            return False
        self._errors.count(error)
        self._changes.changed(req_id)
        return True
