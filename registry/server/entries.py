"""The registry's records: an entry (its states and limits are named in ``registry.states``
and ``registry.settings``), the entry itself and its staged items, the tombstones of the
entries that ended, and the error a caller gets for an entry that ended.
``registry.server.state`` holds the rules that move entries between states (and re-exports
these names).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, ValuesView
from typing import Any

from registry.errors import AlreadyReleased, Cancelled, EncodeFailed, Expired, RegistryError, Unavailable
from registry.settings import Limits  # noqa: F401 - re-exported with the lifecycle's names
from registry.states import (  # noqa: F401 - re-exported: the lifecycle's names
    CANCELLED, EXPIRED, FAILED, LIVE_STATES, MAX_LIST_LIMIT, OPEN, PENDING, RELEASED, STAGED, TERMINAL_STATES, UNKNOWN,
)


@dataclasses.dataclass(slots=True)
class StagedItem:
    """One staged embedding: its metadata, the handle of its bytes (an ObjectRef), and,
    for an item small enough to ride in a fetch's reply, the item itself (``value``)."""

    meta: dict[str, Any]
    ref: Any
    value: Any = None


@dataclasses.dataclass(slots=True)
class Entry:
    req_id: str
    digest: str
    receive_count: int
    created_at: float
    state: str = PENDING
    expires_at: float = 0.0  # encode_timeout_s after accept, then ttl_s after staging
    deadline: float = 0.0  # the next time the timer looks at it: expires_at, or a pull's grace ending first
    items: list[StagedItem] | None = None  # set only while staged
    metas: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    received: dict[int, float] = dataclasses.field(default_factory=dict)  # rank -> first fetch
    # Ranks sent the items over HTTP, not counted yet: rank -> when it is counted unless it pulls again.
    delivering: dict[int, float] = dataclasses.field(default_factory=dict)
    endpoints: dict[str, int] = dataclasses.field(default_factory=dict)  # claimed endpoint -> rank
    open_count: bool = False  # accepted with receive_count OPEN: the ranks' claims fix it
    input_bytes: int = 0  # the media it holds while pending
    staged_at: float | None = None
    ended_at: float | None = None
    error: RegistryError | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(m.get("nbytes", 0)) for m in self.metas)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "req_id": self.req_id,
            "state": self.state,
            "receive_count": self.receive_count,
            "received_ranks": sorted(self.received),
            "delivering_ranks": sorted(self.delivering),
            "items": [dict(m) for m in self.metas],
            "created_at": self.created_at,
            "staged_at": self.staged_at,
            "ended_at": self.ended_at,
        }
        if self.error is not None:
            out["error"] = {"code": self.error.code, "message": self.error.public_message()}
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class FetchResult:
    items: list[StagedItem]
    released: bool


def ended_error(entry: Entry) -> RegistryError:
    """The error a caller gets for an entry in a terminal state."""
    req_id, when = entry.req_id, entry.ended_at
    if entry.state == RELEASED:
        ranks = sorted(entry.received)
        return AlreadyReleased(
            f"req_id {req_id} was released at {when:.3f} after ranks {ranks} received it",
            req_id,
            {"received_ranks": ranks, "released_at": when},
        )
    if entry.state == EXPIRED:
        return Expired(
            f"req_id {req_id} expired at {when:.3f} before every rank received it "
            f"(ranks that did: {sorted(entry.received)}); encode it again",
            req_id,
            {"received_ranks": sorted(entry.received), "expired_at": when},
        )
    if entry.state == CANCELLED:
        return Cancelled(f"req_id {req_id} was cancelled at {when:.3f}", req_id, {"cancelled_at": when})
    cause = entry.error
    if isinstance(cause, Unavailable):  # lost with a node, or the encoders were down: retryable as is
        return cause.fresh()
    return EncodeFailed(
        f"encoding req_id {req_id} failed: [{cause.code if cause else 'unknown'}] {cause}",
        req_id,
        {"cause": {"code": cause.code, "message": cause.message} if cause else None},
    )


class Tombstones:
    """Ended entries, kept without their refs so a late caller learns what happened:
    oldest end first, bounded by age (``tombstone_ttl_s``) and number (``max_tombstones``).

    Pruned whenever they are read or added to, under the limits ``limits()`` gives then
    (the registry's limits may change while it runs).
    """

    def __init__(self, limits: Callable[[], Limits]):
        self._limits = limits
        self._ended: OrderedDict[str, Entry] = OrderedDict()

    def get(self, req_id: str, now: float) -> Entry | None:
        self.prune(now)
        return self._ended.get(req_id)

    def add(self, entry: Entry, now: float) -> None:
        self._ended[entry.req_id] = entry
        self.prune(now)

    def forget(self, req_id: str) -> None:
        del self._ended[req_id]

    def values(self, now: float) -> ValuesView[Entry]:
        self.prune(now)
        return self._ended.values()

    def prune(self, now: float) -> None:
        limits = self._limits()
        horizon = now - limits.tombstone_ttl_s
        ended = self._ended
        while ended and (len(ended) > limits.max_tombstones or next(iter(ended.values())).ended_at <= horizon):
            ended.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ended)


class Deadlines:
    """When each live entry is due next: a heap of (deadline, seq, req_id). A row goes stale
    when its entry ends or is given another deadline; stale rows are dropped as they surface."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()

    def set(self, entry: Entry, deadline: float) -> None:
        entry.deadline = deadline
        heapq.heappush(self._heap, (deadline, next(self._seq), entry.req_id))

    def next(self, live: dict[str, Entry]) -> tuple[float, str] | None:
        """The earliest (deadline, req_id) still current among the ``live`` entries."""
        while self._heap:
            deadline, _, req_id = self._heap[0]
            entry = live.get(req_id)
            if entry is not None and entry.deadline == deadline:
                return deadline, req_id
            heapq.heappop(self._heap)
        return None

    def pop(self) -> None:
        """Drop the earliest row (``next`` just returned it)."""
        heapq.heappop(self._heap)
