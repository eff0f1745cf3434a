"""The staged-embedding lifecycle: the registry's rules, in plain Python.

One ``Entry`` per ``req_id``::

    (new) --accept--> pending --stage--> staged --last distinct rank fetched--> released
                      pending --fail---> failed
                      staged  --lose---> failed   (its objects died with their node)
           pending | staged --cancel---> cancelled
           pending | staged --expire---> expired
    (new) --refuse--> failed   (refused before it was accepted, so its ranks learn why)

``released``, ``expired``, ``cancelled`` and ``failed`` are terminal: the entry
drops its object refs at once and stays only as a *tombstone* (metadata, no refs)
so a late caller learns what happened instead of waiting. Tombstones are bounded
by age (``tombstone_ttl_s``) and by number (``max_tombstones``, oldest first):
``entries.Tombstones`` keeps them. Any other transition is a bug and raises ``IllegalTransition``.

Rules:

* ``receive_count`` (1..``max_receive_count``) is fixed at accept; receivers are
  ranks ``0 .. receive_count-1``. Release happens exactly when the last distinct
  rank is counted; a repeated fetch by a rank returns the same items and does not
  count again.
* A rank is counted only once it has the items. A Ray rank's ``fetch`` hands it the refs
  in the reply it waits for: counted at once. A rank sent the items over HTTP (``deliver``)
  may not get them (a dropped connection, a read that timed out): it is counted when it
  acknowledges (``fetch``), or ``http_pull_grace_s`` after its last pull if it does not
  (a plain HTTP client); until then its repeated pull is answered again. At the ttl, an
  entry whose every rank is counted or in its grace is not expired: it waits for the
  graces (each capped at ``ttl_s`` + ``http_pull_grace_s`` after staging) and is released.
* Ranks known by endpoint (SGLang's protocol: each TP rank registers its receive
  URL and the count): an entry accepted with ``receive_count`` ``OPEN`` takes its
  count from the first ``claim``, which may come before the accept; each distinct
  endpoint claims the next rank number, a repeated claim gets the same one, a
  claim with another count or past the count is refused, a claim of an ended
  entry gets that entry's error at once.
* Deadlines: a pending entry expires ``encode_timeout_s`` after accept; a staged
  entry ``ttl_s`` after staging (but see the HTTP graces above). ``expire_due`` applies them.
* Admission (``registry.server.admission``): a *new* request may be refused ``overloaded``
  (requests, staged bytes, media held); retries of live requests are always answered.
* Accepting a live ``req_id`` again with the same request (items digest and
  receive_count) returns the existing entry; with a different one it is a
  ``conflict``. A released ``req_id`` cannot be reused (``already_released``);
  one that failed, expired or was cancelled can be encoded afresh.
* A result that arrives for an entry no longer pending (cancelled, expired,
  replaced by a fresh encode of the same req_id, or unknown after a restart) is
  refused: ``stage``/``fail`` (given the entry ``accept`` returned) return False
  and the caller drops the refs, so nothing is staged that nobody owns.
* A staged entry whose objects were lost (the node holding them died) is ended
  ``failed`` by ``lose`` with the error every later fetch gets, so its other ranks
  are told at once instead of each finding the objects gone.

Who calls what: the ingress ``accept``s, ``cancel``s, ``describe``s, ``claim``s an
endpoint's rank for SGLang's ranks and ``refuse``s what it turned away; the encode task
``stage``s or ``fail``s; ranks ``fetch`` (and report objects they found lost, which the
registry checks before calling ``lose``), and acknowledge with the same ``fetch``; a push
to a rank outside Ray reads the items with ``fetch(count=False)`` (the rank is counted at
its receiver's acknowledgement, so a lost push never counts), an HTTP pull with
``deliver``; schedulers read ``state_of``, operators ``list_entries``; a timer calls
``expire_due`` at ``next_deadline``. Time is passed in (``now``, seconds) so tests drive
the clock. ``fetch`` returning ``None`` means "not yet": the caller waits for a change to
that ``req_id`` (the actor uses events, never polling).
"""

from __future__ import annotations

import heapq
import itertools

from registry.server.entries import (  # noqa: F401 - re-exported: the lifecycle's names
    CANCELLED, EXPIRED, FAILED, LIVE_STATES, MAX_LIST_LIMIT, OPEN, PENDING, RELEASED, STAGED, TERMINAL_STATES, UNKNOWN,
    Deadlines, Entry, FetchResult, Limits, StagedItem, Tombstones, ended_error,
)
from registry.checks import check_rank
from registry.errors import Conflict, InvalidRank, InvalidRequest, RegistryError, UnknownRequest
from registry.server.admission import check_admission

_ALLOWED = {
    PENDING: {STAGED, FAILED, CANCELLED, EXPIRED},
    STAGED: {RELEASED, CANCELLED, EXPIRED, FAILED},
}


class IllegalTransition(RuntimeError):
    """A transition the lifecycle forbids was attempted: a bug in the caller."""


class RegistryState:
    """The table of entries and tombstones. Not thread-safe: one event loop owns it."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self._live: dict[str, Entry] = {}
        self._ended = Tombstones(lambda: self.limits)  # the limits as they are at each prune
        self._deadlines = Deadlines()
        # Kept incrementally so stats are O(1) on every change.
        self._live_counts = dict.fromkeys(LIVE_STATES, 0)
        self._staged_bytes = self._pending_input_bytes = self._bytes_staged_ever = self._live_refs = 0
        self.totals = dict.fromkeys(("accepted", "staged", *TERMINAL_STATES), 0)

    # --- ingress ------------------------------------------------------------------

    def accept(self, req_id: str, digest: str, receive_count: int, now: float, input_bytes: int = 0) -> tuple[Entry, bool]:
        """Create a pending entry, or return the live one for a retry. -> (entry, created).
        ``receive_count`` ``OPEN``: the ranks' first ``claim`` fixes it. ``input_bytes``: the
        media it holds until its encode ends (admission counts them)."""
        self._check_count(receive_count, req_id, open_ok=True)
        live = self._live.get(req_id)
        if live is not None:
            asked = OPEN if live.open_count else live.receive_count
            if live.digest != digest or asked != receive_count:
                raise Conflict(
                    f"req_id {req_id} is already {live.state} with different items or receive_count; "
                    "use a new req_id for a different request",
                    req_id,
                )
            return live, False
        ended = self._ended.get(req_id, now)
        if ended is not None and ended.state == RELEASED:
            raise ended_error(ended)
        self._admit(req_id, input_bytes)
        if ended is not None:
            self._ended.forget(req_id)  # failed/expired/cancelled: a fresh attempt is allowed
        entry = Entry(req_id, digest, receive_count, created_at=now, open_count=receive_count == OPEN, input_bytes=input_bytes)
        self._pending_input_bytes += input_bytes
        self._live[req_id] = entry
        self._live_counts[PENDING] += 1
        self._set_expiry(entry, now + self.limits.encode_timeout_s)
        self.totals["accepted"] += 1
        return entry, True

    def _admit(self, req_id: str, input_bytes: int) -> None:
        staged = self.totals["staged"]
        check_admission(self.limits, req_id, pending=self._live_counts[PENDING], staged_bytes=self._staged_bytes,
                        mean_staged_bytes=self._bytes_staged_ever // staged if staged else 0,
                        pending_input_bytes=self._pending_input_bytes, input_bytes=input_bytes)

    def cancel(self, req_id: str, now: float) -> Entry:
        """Cancel a live entry (dropping its refs); an ended entry is returned as is."""
        entry = self._live.get(req_id)
        if entry is not None:
            self._end(entry, CANCELLED, now)
            return entry
        return self.get(req_id, now)

    def get(self, req_id: str, now: float) -> Entry:
        entry = self._find(req_id, now)
        if entry is None:
            raise UnknownRequest(f"no request with req_id {req_id} is known (or its record has aged out)", req_id)
        return entry

    # --- encode task --------------------------------------------------------------

    def stage(self, entry: Entry, items: list[StagedItem], now: float) -> bool:
        """Stage the encoded items of ``entry`` (as ``accept`` returned it).

        False: ``entry`` is no longer the pending entry of its req_id (it was cancelled
        or expired, or the req_id was encoded afresh since); the caller drops the items.
        Taking the entry, not the req_id, keeps a stale result out of a newer entry.
        """
        if not self._is_pending(entry):
            return False
        self._move(entry, STAGED)
        entry.items = [StagedItem({"index": i, **item.meta}, item.ref, item.value) for i, item in enumerate(items)]
        entry.metas = [item.meta for item in entry.items]
        entry.staged_at = now
        self._staged_bytes += entry.nbytes
        self._bytes_staged_ever += entry.nbytes
        self._live_refs += len(items)
        self._set_expiry(entry, now + self.limits.ttl_s)
        self.totals["staged"] += 1
        return True

    def fail(self, entry: Entry, error: RegistryError, now: float) -> bool:
        """Record that encoding ``entry`` failed. False, as for ``stage``."""
        if not self._is_pending(entry):
            return False
        entry.error = error.fresh()  # the tombstone must not pin the failed call's frames
        self._end(entry, FAILED, now)
        return True

    def refuse(self, req_id: str, error: RegistryError, now: float) -> bool:
        """Record that ``req_id`` was refused before it was accepted: a ``failed`` tombstone
        with ``error``, so ranks waiting for it (``claim``, ``fetch``) learn why at once.
        False if the registry knows ``req_id`` already (live or ended): its record stands."""
        if req_id in self._live or self._ended.get(req_id, now) is not None:
            return False
        self._ended.add(Entry(req_id, "", OPEN, created_at=now, state=FAILED, error=error.fresh(), ended_at=now), now)
        self.totals[FAILED] += 1
        return True

    def lose(self, req_id: str, error: RegistryError, now: float) -> bool:
        """End staged ``req_id`` ``failed`` with ``error`` because its objects are gone.

        False if it is not staged (still pending, or already ended): nothing changes.
        """
        entry = self._live.get(req_id)
        if entry is None or entry.state != STAGED:
            return False
        entry.error = error.fresh()
        self._end(entry, FAILED, now)
        return True

    def _is_pending(self, entry: Entry) -> bool:
        return self._live.get(entry.req_id) is entry and entry.state == PENDING

    # --- ranks --------------------------------------------------------------------

    def fetch(self, req_id: str, rank: int, now: float, count: bool = True) -> FetchResult | None:
        """Record ``rank`` as a receiver and return the items; None: not staged yet.

        ``count=False`` checks and returns the same without recording the rank: for a
        push that counts only once its receiver acknowledges (then ``fetch`` again)."""
        check_rank(rank, lambda message: InvalidRank(message, req_id))
        entry = self._find(req_id, now)
        if entry is None:
            return None
        if entry.receive_count == OPEN:
            if entry.state in LIVE_STATES:
                raise InvalidRank(f"req_id {req_id} has no receive_count yet: its ranks claim their endpoints first", req_id)
        elif rank >= entry.receive_count:
            raise InvalidRank(
                f"rank {rank} is out of range: req_id {req_id} has receive_count={entry.receive_count}, "
                f"so ranks are 0..{entry.receive_count - 1}",
                req_id,
            )
        if entry.state == PENDING:
            return None
        if entry.state != STAGED:
            raise ended_error(entry)
        assert entry.items is not None
        items = entry.items
        if not count:
            return FetchResult(items, released=False)
        entry.received.setdefault(rank, now)
        if entry.delivering.pop(rank, None) is not None:
            self._schedule(entry, now)  # its grace no longer sets the deadline
        if len(entry.received) < entry.receive_count:
            return FetchResult(items, released=False)
        self._end(entry, RELEASED, now)
        return FetchResult(items, released=True)

    def deliver(self, req_id: str, rank: int, now: float) -> FetchResult | None:
        """``fetch`` for a rank sent the items over HTTP, which may not get them: it is not
        counted now but ``http_pull_grace_s`` after this (its last) pull, or by a ``fetch``
        (its acknowledgement) before; a pull again meanwhile is answered the same items.
        A rank counted already is answered as a repeated ``fetch``."""
        result = self.fetch(req_id, rank, now, count=False)
        if result is None:
            return None
        entry = self._live[req_id]
        if rank not in entry.received:
            # Never past ttl_s + the grace after staging, however often the rank pulls again.
            entry.delivering[rank] = min(now, entry.expires_at) + self.limits.http_pull_grace_s
            self._schedule(entry, now)
        return result

    def claim(self, req_id: str, endpoint: str, receive_count: int, now: float) -> int | None:
        """The rank number of ``endpoint`` among ``req_id``'s ranks (claimed now if new);
        None: ``req_id`` is not known yet (the caller waits for its accept)."""
        self._check_count(receive_count, req_id)
        entry = self._find(req_id, now)
        if entry is None:
            return None
        if entry.state not in LIVE_STATES:
            raise ended_error(entry)
        if entry.receive_count == OPEN:
            entry.receive_count = receive_count
        elif entry.receive_count != receive_count:
            raise InvalidRequest(
                f"Inconsistent receive_count for req_id {req_id}: its ranks registered "
                f"{entry.receive_count}, this one {receive_count}",
                req_id,
            )
        rank = entry.endpoints.get(endpoint)
        if rank is None:
            if len(entry.endpoints) >= entry.receive_count:
                raise InvalidRank(
                    f"req_id {req_id} has all its {entry.receive_count} ranks registered "
                    f"({', '.join(entry.endpoints)}); {endpoint} would be one too many",
                    req_id,
                )
            rank = entry.endpoints[endpoint] = len(entry.endpoints)
        return rank

    # --- timer --------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        due = self._deadlines.next(self._live)
        return None if due is None else due[0]

    def expire_due(self, now: float) -> list[Entry]:
        """Apply every deadline that has passed: count the HTTP ranks whose grace ended
        (releasing an entry they complete), and expire entries past ``expires_at`` unless
        every rank is counted or in its grace. Returns the entries this ended, released or
        expired. Their tombstones may already be pruned (``tombstone_ttl_s`` 0,
        ``max_tombstones`` reached): read what happened from the entries returned."""
        ended = []
        while (due := self._deadlines.next(self._live)) is not None and due[0] <= now:
            self._deadlines.pop()
            entry = self._live[due[1]]
            for rank, until in list(entry.delivering.items()):
                if until <= now:
                    del entry.delivering[rank]
                    entry.received.setdefault(rank, now)
            counted = entry.receive_count != OPEN and len(entry.received) >= entry.receive_count
            in_grace = entry.receive_count != OPEN and len(entry.received) + len(entry.delivering) >= entry.receive_count
            if entry.state == STAGED and counted:
                self._end(entry, RELEASED, now)
            elif entry.expires_at <= now and not in_grace:
                self._end(entry, EXPIRED, now)
            else:
                self._schedule(entry, now, popped=True)
                continue
            ended.append(entry)
        self._ended.prune(now)
        return ended

    # --- views --------------------------------------------------------------------

    def is_live(self, req_id: str) -> bool:
        return req_id in self._live

    def knows(self, req_id: str, now: float) -> bool:
        """Whether ``req_id`` has an entry or a tombstone."""
        return self._find(req_id, now) is not None

    def state_of(self, req_id: str, now: float) -> str:
        """The state of ``req_id``'s entry or tombstone, else ``UNKNOWN``. Never raises."""
        entry = self._find(req_id, now)
        return UNKNOWN if entry is None else entry.state

    def list_entries(self, state: str | None, after: str | None, limit: int, now: float) -> tuple[list[Entry], bool]:
        """Entries and tombstones in ``req_id`` order after ``after``, of ``state`` if given:
        up to ``limit`` of them, and whether more follow (a page of an operator's listing)."""
        rows = itertools.chain(self._live.values(), self._ended.values(now))
        chosen = (e for e in rows if (state is None or e.state == state) and (after is None or e.req_id > after))
        page = heapq.nsmallest(limit + 1, chosen, key=lambda entry: entry.req_id)
        return page[:limit], len(page) > limit

    def stats(self, now: float) -> dict[str, int]:
        self._ended.prune(now)
        return {
            "pending": self._live_counts[PENDING],
            "staged": self._live_counts[STAGED],
            "staged_bytes": self._staged_bytes,
            "pending_input_bytes": self._pending_input_bytes,
            "live_refs": self._live_refs,
            "tombstones": len(self._ended),
            **{f"{name}_total": count for name, count in self.totals.items()},
        }

    # --- internals ----------------------------------------------------------------

    def _find(self, req_id: str, now: float) -> Entry | None:
        """The live entry of ``req_id``, else its tombstone (aged ones pruned first), else None."""
        entry = self._live.get(req_id)
        return self._ended.get(req_id, now) if entry is None else entry

    def _check_count(self, receive_count: object, req_id: str, open_ok: bool = False) -> None:
        limit = self.limits.max_receive_count
        if not (open_ok and receive_count == OPEN) and (
            isinstance(receive_count, bool) or not isinstance(receive_count, int) or not 1 <= receive_count <= limit
        ):
            raise InvalidRequest(f"receive_count must be between 1 and {limit}, got {receive_count!r}", req_id)

    def _move(self, entry: Entry, new_state: str) -> None:
        if new_state not in _ALLOWED.get(entry.state, ()):
            raise IllegalTransition(f"{entry.req_id}: {entry.state} -> {new_state} is not allowed")
        if entry.state == PENDING:
            self._pending_input_bytes -= entry.input_bytes  # its encode ended: its media is let go
        self._live_counts[entry.state] -= 1
        if new_state in self._live_counts:
            self._live_counts[new_state] += 1
        entry.state = new_state

    def _end(self, entry: Entry, new_state: str, now: float) -> None:
        if entry.state == STAGED:
            self._staged_bytes -= entry.nbytes
            self._live_refs -= len(entry.items or ())
        self._move(entry, new_state)
        entry.items = None  # the registry's refs go here; readers keep their own
        entry.ended_at = now
        del self._live[entry.req_id]
        self._ended.add(entry, now)
        self.totals[new_state] += 1

    def _set_expiry(self, entry: Entry, expires_at: float) -> None:
        entry.expires_at = expires_at
        self._deadlines.set(entry, expires_at)

    def _schedule(self, entry: Entry, now: float, *, popped: bool = False) -> None:
        """Set the entry's next deadline: its expiry, or a pull's grace ending sooner (only
        the graces once the expiry has passed). ``popped``: its row was just taken off the
        heap, so it needs one even if the deadline is the same."""
        graces = list(entry.delivering.values())
        expiry = [entry.expires_at] if entry.expires_at > now or not graces else []
        deadline = min(graces + expiry)
        if popped or deadline != entry.deadline:
            self._deadlines.set(entry, deadline)
