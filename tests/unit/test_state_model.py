"""Model-based test of the registry's rules: random interleavings against a plain reference model.

Hypothesis drives ``RegistryState`` and a deliberately naive model of the same rules (a
dict per request) with encode (a fixed ``receive_count``, or ``OPEN``: the ranks' claims
fix it), duplicate encode, stage, late results, failures, refusals before accept, fetches
by valid/invalid/repeated ranks, HTTP deliveries counted at their acknowledgement or when
their grace ends, endpoint claims, cancel, staged objects lost with their node, and a fake
clock that expires entries, then checks after every step that both agree and that the
invariants hold: an entry is released exactly when ``receive_count`` distinct ranks are
counted, never earlier and never on a delivery alone; nothing fetches after release; the
registry holds refs for staged entries only; tombstones stay bounded.
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
from registry.server.state import OPEN, RegistryState, StagedItem

# Deadlines close to each other and to the clock's steps, so their interleavings come up often.
LIMITS = AppConfig(ttl_s=4.0, encode_timeout_s=3.0, max_receive_count=3, tombstone_ttl_s=30.0, max_tombstones=4,
                   http_pull_grace_s=2.0).limits()
REQ_IDS = st.sampled_from(["a", "b", "c"])
# Valid ranks more often than invalid ones (-1; 3, past max_receive_count).
RANKS = st.sampled_from([0, 1, 2, 0, 1, -1, 3])
DIGESTS = st.sampled_from(["x", "y"])
ENDPOINTS = st.sampled_from(["e0", "e1", "e2", "e3"])
ITEMS_PER_ENTRY = 2
ERROR_FOR = {"released": AlreadyReleased, "expired": Expired, "cancelled": Cancelled, "failed": EncodeFailed}


class RegistryRules(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = RegistryState(LIMITS)
        self.now = 0.0
        # req_id -> {state, digest, count (OPEN until claimed), open, received, delivering, expires_at, endpoints}
        self.live: dict[str, dict] = {}
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

    def _find(self, req_id):
        self._prune()
        return self.live.get(req_id) or self.ended.get(req_id)

    # --- rules ---------------------------------------------------------------------

    @rule(req_id=REQ_IDS, digest=DIGESTS, count=st.sampled_from([1, 2, OPEN, 1, 3, -1, 4]))
    def encode(self, req_id, digest, count):
        self._prune()
        if count != OPEN and not 1 <= count <= LIMITS.max_receive_count:
            expected = InvalidRequest
        elif req_id in self.live:
            live = self.live[req_id]
            asked = OPEN if live["open"] else live["count"]
            expected = None if live["digest"] == digest and asked == count else Conflict
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
            self.live[req_id] = dict(state="pending", digest=digest, count=count, open=count == OPEN, received=set(),
                                     delivering={}, expires_at=self.now + LIMITS.encode_timeout_s, endpoints={})

    def _attempt(self, req_id, first):
        attempts = self.attempts.get(req_id)
        return None if not attempts else attempts[0] if first else attempts[-1]

    @rule(req_id=REQ_IDS)
    def encode_result(self, req_id):
        """The latest attempt's encode result arrives: staged if its entry is still pending."""
        self._encode_result(req_id, first=False)

    @rule(req_id=REQ_IDS)
    def first_encode_result(self, req_id):
        """The first attempt's result arrives, late if the req_id was encoded afresh since: dropped then."""
        self._encode_result(req_id, first=True)

    def _encode_result(self, req_id, first):
        entry = self._attempt(req_id, first)
        if entry is None:
            return
        items = [StagedItem({"nbytes": 10, "mm_hash": f"{req_id}{i}"}, object()) for i in range(ITEMS_PER_ENTRY)]
        current = entry is self.attempts[req_id][-1] and req_id in self.live and self.live[req_id]["state"] == "pending"
        assert self.state.stage(entry, items, self.now) == current
        if current:
            self.live[req_id].update(state="staged", expires_at=self.now + LIMITS.ttl_s)

    @rule(req_id=REQ_IDS, rank=RANKS)
    def fetch(self, req_id, rank):
        """A rank's fetch, counted at once: a Ray rank's, or an acknowledgement."""
        self._receive(req_id, rank, "fetch")

    @rule(req_id=REQ_IDS, rank=RANKS)
    def deliver(self, req_id, rank):
        """An HTTP delivery, counted at its acknowledgement or when its grace ends."""
        self._receive(req_id, rank, "deliver")

    def _receive(self, req_id, rank, how):
        entry = self._find(req_id)
        open_live = entry is not None and entry["count"] == OPEN and req_id in self.live
        invalid = rank < 0 or open_live or (entry is not None and entry["count"] != OPEN and rank >= entry["count"])
        try:
            result = getattr(self.state, how)(req_id, rank, self.now)
        except RegistryError as exc:
            if invalid:
                assert isinstance(exc, InvalidRank), exc
            else:
                assert entry is not None and type(exc) is entry["error"], (exc, entry and entry["state"])
            return
        assert not invalid, (req_id, rank, entry)
        if entry is None or entry["state"] == "pending":
            assert result is None
            return
        assert entry["state"] == "staged", entry  # nothing fetches from an ended entry
        assert result is not None and len(result.items) == ITEMS_PER_ENTRY
        if how == "deliver":
            if rank not in entry["received"]:
                entry["delivering"][rank] = min(self.now, entry["expires_at"]) + LIMITS.http_pull_grace_s
            assert not result.released  # a delivery alone never releases
            return
        entry["received"].add(rank)
        entry["delivering"].pop(rank, None)
        released = len(entry["received"]) == entry["count"]
        assert result.released == released  # exactly at the last distinct rank, never earlier
        if released:
            self._end(req_id, "released")

    @rule(req_id=REQ_IDS, endpoint=ENDPOINTS, count=st.sampled_from([OPEN, 1, 2, 3]))
    def claim(self, req_id, endpoint, count):
        """A rank known by its endpoint registers (SGLang's ranks): the first claim fixes an
        OPEN count, a repeat gets the same rank, one too many or another count is refused."""
        entry = self._find(req_id)
        if count == OPEN:
            expected = InvalidRequest
        elif entry is None:
            expected = None
        elif req_id not in self.live:
            expected = entry["error"]
        elif entry["count"] != OPEN and entry["count"] != count:
            expected = InvalidRequest
        elif endpoint not in entry["endpoints"] and len(entry["endpoints"]) >= count:
            expected = InvalidRank
        else:
            expected = "rank"
        try:
            rank = self.state.claim(req_id, endpoint, count, self.now)
        except RegistryError as exc:
            assert type(exc) is expected, (exc, expected)
            return
        if expected is None:
            assert rank is None  # not known yet: the caller waits for its accept
            return
        assert expected == "rank", (rank, expected)
        entry["count"] = count
        assert rank == entry["endpoints"].setdefault(endpoint, len(entry["endpoints"]))

    @rule(req_id=REQ_IDS, what=st.sampled_from(["fail", "fail_late", "refuse", "refuse_retryable", "lose", "cancel"]))
    def disrupt(self, req_id, what):
        """What ends an entry early, one rule for all (so the rules that fetch come up as often):
        its encode fails (the current attempt, or a late one), it is refused before accept,
        its objects are lost with their node, or it is cancelled."""
        if what.startswith("fail"):
            self._encode_failure(req_id, first=what == "fail_late")
        elif what.startswith("refuse"):
            self._refuse(req_id, retryable=what == "refuse_retryable")
        elif what == "lose":
            self._objects_lost(req_id)
        else:
            self._cancel(req_id)

    def _encode_failure(self, req_id, first):
        entry = self._attempt(req_id, first)
        if entry is None:
            return
        current = entry is self.attempts[req_id][-1] and req_id in self.live and self.live[req_id]["state"] == "pending"
        assert self.state.fail(entry, EncodeFailed("boom", req_id), self.now) == current
        if current:
            self._end(req_id, "failed")

    def _refuse(self, req_id, retryable):
        """Turned away before the registry accepted it (a bad image; or the encoders down)."""
        known = self._find(req_id) is not None
        cause = Unavailable("down", req_id) if retryable else InvalidRequest("bad image", req_id)
        assert self.state.refuse(req_id, cause, self.now) == (not known)
        if not known:
            self.ended[req_id] = dict(state="failed", count=OPEN, received=set(), delivering={}, ended_at=self.now,
                                      error=Unavailable if retryable else EncodeFailed)
            self._prune()

    def _objects_lost(self, req_id):
        """The node holding an entry's objects died (a rank found them gone)."""
        self._prune()
        staged = req_id in self.live and self.live[req_id]["state"] == "staged"
        assert self.state.lose(req_id, Unavailable("lost with their node", req_id), self.now) == staged
        if staged:
            self._end(req_id, "failed", Unavailable)

    def _cancel(self, req_id):
        self._prune()
        try:
            entry = self.state.cancel(req_id, self.now)
        except UnknownRequest:
            assert req_id not in self.live and req_id not in self.ended
            return
        if req_id in self.live:
            self._end(req_id, "cancelled")
        assert entry.state == self.ended[req_id]["state"]

    @rule(seconds=st.sampled_from([0.5, 1.0, 1.5, 0.5, 2.0, 3.0, 5.0, 31.0]))
    def advance_clock(self, seconds):
        self.now += seconds
        ends = {}
        for req_id, entry in self.live.items():
            for rank in [r for r, until in entry["delivering"].items() if until <= self.now]:
                del entry["delivering"][rank]  # its grace ended: counted
                entry["received"].add(rank)
            count = entry["count"]
            if entry["state"] == "staged" and count != OPEN and len(entry["received"]) >= count:
                ends[req_id] = "released"
            elif entry["expires_at"] <= self.now and (count == OPEN or len(entry["received"]) + len(entry["delivering"]) < count):
                ends[req_id] = "expired"
        ended = [(entry.req_id, entry.state) for entry in self.state.expire_due(self.now)]
        assert sorted(ended) == sorted(ends.items())
        for req_id, state in ended:  # entries due together end in the registry's order (tombstones age by it)
            self._end(req_id, state)
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
            assert actual.receive_count == entry["count"]
            assert (actual.items is not None) == (entry["state"] == "staged")
            if req_id in self.live:
                assert actual.delivering == entry["delivering"] and actual.endpoints == entry["endpoints"]
                assert not set(actual.delivering) & set(actual.received)  # a rank is in one or the other


TestRegistryRules = RegistryRules.TestCase
# 300 runs of up to 80 steps: thousands of steps on every CI run, several seconds.
TestRegistryRules.settings = settings(max_examples=300, stateful_step_count=80, deadline=None)
