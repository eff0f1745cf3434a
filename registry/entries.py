"""The registry's records: an entry's states, its limits, the entry itself and its staged
items, and the error a caller gets for an entry that ended. ``registry.state`` holds the
rules that move entries between states (and re-exports these names).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from registry.errors import AlreadyReleased, Cancelled, EncodeFailed, Expired, RegistryError, Unavailable

PENDING, STAGED, RELEASED, EXPIRED, CANCELLED, FAILED = (
    "pending", "staged", "released", "expired", "cancelled", "failed",
)
# What ``state_of`` answers for a req_id with no entry and no tombstone: never seen,
# aged out, or lost with a registry restart.
UNKNOWN = "unknown"
LIVE_STATES = (PENDING, STAGED)
TERMINAL_STATES = (RELEASED, EXPIRED, CANCELLED, FAILED)
# Most entries one page of ``list_entries`` holds (the registry's and the HTTP route's bound).
MAX_LIST_LIMIT = 1000
# The receive_count of an entry whose ranks will say how many they are (``claim``).
OPEN = 0


@dataclasses.dataclass(frozen=True)
class Limits:
    """The lifecycle's limits, named as ``deployments.AppConfig``'s keys, which hold every
    default and description (``AppConfig.limits()`` builds this)."""

    ttl_s: float
    encode_timeout_s: float
    max_receive_count: int
    tombstone_ttl_s: float
    max_tombstones: int
    # Admission: past either, a new request is refused with ``overloaded``.
    max_pending_requests: int
    max_staged_bytes: int


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
    deadline: float = 0.0
    items: list[StagedItem] | None = None  # set only while staged
    metas: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    received: dict[int, float] = dataclasses.field(default_factory=dict)  # rank -> first fetch
    endpoints: dict[str, int] = dataclasses.field(default_factory=dict)  # claimed endpoint -> rank
    open_count: bool = False  # accepted with receive_count OPEN: the ranks' claims fix it
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
