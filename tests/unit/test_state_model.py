"""Model-based test of the registry's rules: random interleavings against a plain reference model.

Hypothesis drives ``RegistryState`` and a deliberately naive model of the same
rules (a dict per request) with encode, duplicate encode, stage, late results,
failures, fetches by valid/invalid/repeated ranks, cancel, staged objects lost
with their node, and a fake clock that
expires entries, then checks after every step that both agree and that the
invariants hold: an entry is released exactly when ``receive_count`` distinct
ranks fetched, never earlier; nothing fetches after release; the registry holds
refs for staged entries only; tombstones stay bounded.
"""

from collections import OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from registry.errors import (
    AlreadyReleased,
    Cancelled,
    Conflict,
    EncodeFailed,
    Expired,
    InvalidRank,
    InvalidRequest,
    RegistryError,
    Unavailable,
    UnknownRequest,
)
from deployments.config import AppConfig
from registry.server.state import RegistryState, StagedItem

LIMITS = AppConfig(ttl_s=10.0, encode_timeout_s=5.0, max_receive_count=3, tombstone_ttl_s=30.0, max_tombstones=4).limits()
REQ_IDS = st.sampled_from(["a", "b", "c", "d", "e", "f"])
DIGESTS = st.sampled_from(["x", "y"])
ITEMS_PER_ENTRY = 2
ERROR_FOR = {"released": AlreadyReleased, "expired": Expired, "cancelled": Cancelled, "failed": EncodeFailed}


class RegistryRules(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = RegistryState(LIMITS)
        self.now = 0.0
        self.live: dict[str, dict] = {}  # req_id -> {state, digest, count, received, deadline}
        self.ended: OrderedDict[str, dict] = OrderedDict()  # oldest end first
        self.attempts: dict[str, list] = {}  # req_id -> every entry accept created, oldest first

    # --- the reference model's own bookkeeping ---------------------------------------

    def _prune(self):
        while self.ended and (
            len(self.ended) > LIMITS.max_tombstones
            or next(iter(self.ended.values()))["ended_at"] <= self.now - LIMITS.tombstone_ttl_s
        ):
            self.ended.popitem(last=False)

    def _end(self, req_id, state, error=None):
        entry = self.live.pop(req_id)
        entry.update(state=state, ended_at=self.now, error=error or ERROR_FOR[state])
        self.ended[req_id] = entry
        self._prune()

    # --- rules ---------------------------------------------------------------------

    # OPEN (0, a count the ranks' claims fix) is driven in tests/unit/test_endpoint_claims.py.
    @rule(req_id=REQ_IDS, digest=DIGESTS, count=st.sampled_from([-1, 1, 2, 3, 4]))
    def encode(self, req_id, digest, count):
        self._prune()
        if not 1 <= count <= LIMITS.max_receive_count:
            expected = InvalidRequest
        elif req_id in self.live:
            same = self.live[req_id]["digest"] == digest and self.live[req_id]["count"] == count
            expected = None if same else Conflict
        elif req_id in self.ended and self.ended[req_id]["state"] == "released":
            expected = AlreadyReleased
        else:
            expected = "new"
        try:
            entry, created = self.state.accept(req_id, digest, count, self.now)
        except RegistryError as exc:
            assert type(exc) is expected, (exc, expected)
            return
        assert created == (expected == "new"), (created, expected)
        if created:
            self.attempts.setdefault(req_id, []).append(entry)
            self.ended.pop(req_id, None)
            self.live[req_id] = dict(state="pending", digest=digest, count=count, received=set(),
                                     deadline=self.now + LIMITS.encode_timeout_s)

    def _attempt(self, req_id, first):
        attempts = self.attempts.get(req_id)
        return None if not attempts else attempts[0] if first else attempts[-1]

    @rule(req_id=REQ_IDS, first=st.booleans())
    def encode_result(self, req_id, first):
        """An encode's result arrives: staged if its entry is still the pending one, else dropped
        (a late result, or one from an earlier attempt at the same req_id)."""
        entry = self._attempt(req_id, first)
        if entry is None:
            return
        items = [StagedItem({"nbytes": 10, "mm_hash": f"{req_id}{i}"}, object()) for i in range(ITEMS_PER_ENTRY)]
        current = entry is self.attempts[req_id][-1] and req_id in self.live and self.live[req_id]["state"] == "pending"
        assert self.state.stage(entry, items, self.now) == current
        if current:
            self.live[req_id].update(state="staged", deadline=self.now + LIMITS.ttl_s)

    @rule(req_id=REQ_IDS, first=st.booleans())
    def encode_failure(self, req_id, first):
        entry = self._attempt(req_id, first)
        if entry is None:
            return
        current = entry is self.attempts[req_id][-1] and req_id in self.live and self.live[req_id]["state"] == "pending"
        assert self.state.fail(entry, EncodeFailed("boom", req_id), self.now) == current
        if current:
            self._end(req_id, "failed")

    @rule(req_id=REQ_IDS, rank=st.integers(-1, 3))
    def fetch(self, req_id, rank):
        self._prune()
        entry = self.live.get(req_id) or self.ended.get(req_id)
        try:
            result = self.state.fetch(req_id, rank, self.now)
        except RegistryError as exc:
            assert entry is not None or isinstance(exc, InvalidRank)
            if rank < 0 or (entry is not None and rank >= entry["count"]):
                assert isinstance(exc, InvalidRank)
            else:
                assert type(exc) is entry["error"], (exc, entry["state"])
            return
        if entry is None or entry["state"] == "pending":
            assert result is None and 0 <= rank
            return
        assert entry["state"] == "staged", entry  # nothing fetches from an ended entry
        assert result is not None and len(result.items) == ITEMS_PER_ENTRY
        entry["received"].add(rank)
        released = len(entry["received"]) == entry["count"]
        assert result.released == released  # exactly at the last distinct rank, never earlier
        if released:
            self._end(req_id, "released")

    @rule(req_id=REQ_IDS)
    def objects_lost(self, req_id):
        """The node holding an entry's objects died (a rank found them gone)."""
        self._prune()
        staged = req_id in self.live and self.live[req_id]["state"] == "staged"
        assert self.state.lose(req_id, Unavailable("lost with their node", req_id), self.now) == staged
        if staged:
            self._end(req_id, "failed", Unavailable)

    @rule(req_id=REQ_IDS)
    def cancel(self, req_id):
        self._prune()
        try:
            entry = self.state.cancel(req_id, self.now)
        except UnknownRequest:
            assert req_id not in self.live and req_id not in self.ended
            return
        if req_id in self.live:
            self._end(req_id, "cancelled")
        assert entry.state == self.ended[req_id]["state"]

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0, 6.0, 11.0, 31.0]))
    def advance_clock(self, seconds):
        self.now += seconds
        due = sorted(r for r, e in self.live.items() if e["deadline"] <= self.now)
        expired = [entry.req_id for entry in self.state.expire_due(self.now)]
        assert sorted(expired) == due
        for req_id in expired:  # entries due together end in the registry's order (tombstones age by it)
            self._end(req_id, "expired")
        self._prune()

    # --- invariants ------------------------------------------------------------------

    @invariant()
    def agrees_with_the_model(self):
        stats = self.state.stats(self.now)
        self._prune()
        staged = [e for e in self.live.values() if e["state"] == "staged"]
        assert stats["pending"] == sum(e["state"] == "pending" for e in self.live.values())
        assert stats["staged"] == len(staged)
        assert stats["live_refs"] == ITEMS_PER_ENTRY * len(staged)  # refs only while staged
        assert stats["staged_bytes"] == 10 * ITEMS_PER_ENTRY * len(staged)
        assert stats["tombstones"] == len(self.ended) <= LIMITS.max_tombstones
        for req_id, entry in {**self.live, **self.ended}.items():
            actual = self.state.get(req_id, self.now)
            assert actual.state == entry["state"] and set(actual.received) == entry["received"]
            assert (actual.items is not None) == (entry["state"] == "staged")


TestRegistryRules = RegistryRules.TestCase
# 100 runs of up to 60 steps: several thousand steps on every CI run, a few seconds.
TestRegistryRules.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
