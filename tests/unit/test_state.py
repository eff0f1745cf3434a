"""The registry's lifecycle rules, driven directly with a fake clock (no Ray)."""

import pickle

import pytest

from registry.errors import (
    AlreadyReleased,
    Cancelled,
    Conflict,
    EncodeFailed,
    Expired,
    InvalidRank,
    InvalidRequest,
    Overloaded,
    Unavailable,
    UnknownRequest,
)
from deployments.config import AppConfig
from registry.server.state import OPEN, IllegalTransition, RegistryState, StagedItem


def limits(**changed):
    """The app's default limits (``AppConfig``, their one home), with ``changed`` applied."""
    return AppConfig(**changed).limits()


def staged_items(n=2, nbytes=100):
    return [StagedItem({"mm_hash": f"h{i}", "shape": [4, 8], "dtype": "float32", "nbytes": nbytes}, f"ref{i}") for i in range(n)]


@pytest.fixture
def state():
    return RegistryState(limits(ttl_s=10, encode_timeout_s=5, max_receive_count=8, tombstone_ttl_s=100, max_tombstones=3))


def stage_new(state, req_id="r", receive_count=2, now=0.0, n=2):
    entry, _ = state.accept(req_id, "d", receive_count, now)
    assert state.stage(entry, staged_items(n), now)
    return entry


def test_accept_creates_pending_and_retry_joins_it(state):
    entry, created = state.accept("r", "digest", 2, 0.0)
    assert created and entry.state == "pending"
    again, created_again = state.accept("r", "digest", 2, 1.0)
    assert again is entry and not created_again
    assert state.stats(1.0)["pending"] == 1
    assert state.stats(1.0)["accepted_total"] == 1


@pytest.mark.parametrize("count", [-1, 9])
def test_receive_count_out_of_bounds_is_invalid_request(state, count):
    with pytest.raises(InvalidRequest, match="receive_count must be between 1 and 8"):
        state.accept("r", "d", count, 0.0)
    with pytest.raises(UnknownRequest):
        state.get("r", 0.0)


@pytest.mark.parametrize("digest,count", [("other", 2), ("d", 3)])
def test_same_req_id_with_different_request_is_conflict(state, digest, count):
    state.accept("r", "d", 2, 0.0)
    with pytest.raises(Conflict) as info:
        state.accept("r", digest, count, 0.0)
    assert info.value.code == "conflict" and info.value.req_id == "r"


def test_release_exactly_after_last_distinct_rank(state):
    stage_new(state, receive_count=3)
    first = state.fetch("r", 0, 1.0)
    assert first is not None and not first.released and len(first.items) == 2
    again = state.fetch("r", 0, 1.5)  # a retry by rank 0 does not count again
    assert again is not None and not again.released and again.items == first.items
    assert state.get("r", 1.5).state == "staged"
    assert not state.fetch("r", 2, 2.0).released
    last = state.fetch("r", 1, 3.0)
    assert last.released and [i.ref for i in last.items] == ["ref0", "ref1"]
    entry = state.get("r", 3.0)
    assert entry.state == "released" and entry.items is None
    assert state.stats(3.0)["live_refs"] == 0


def test_items_carry_their_index(state):
    stage_new(state, receive_count=1, n=3)
    result = state.fetch("r", 0, 1.0)
    assert [item.meta["index"] for item in result.items] == [0, 1, 2]


def test_fetch_after_release_names_ranks_and_time(state):
    stage_new(state, receive_count=2)
    state.fetch("r", 1, 1.0)
    state.fetch("r", 0, 2.0)
    with pytest.raises(AlreadyReleased) as info:
        state.fetch("r", 0, 3.0)
    assert info.value.details == {"received_ranks": [0, 1], "released_at": 2.0}
    assert "ranks [0, 1]" in info.value.message


@pytest.mark.parametrize("rank", [-1, 2, 5, "0", 1.0, True])
def test_invalid_rank(state, rank):
    stage_new(state, receive_count=2)
    with pytest.raises(InvalidRank):
        state.fetch("r", rank, 1.0)
    assert state.get("r", 1.0).received == {}


def test_fetch_of_pending_or_unknown_means_wait(state):
    assert state.fetch("nobody", 0, 0.0) is None
    state.accept("r", "d", 2, 0.0)
    assert state.fetch("r", 0, 0.0) is None
    with pytest.raises(InvalidRank):  # bounds are known once accepted, even while pending
        state.fetch("r", 2, 0.0)


def test_staged_entry_expires_after_ttl(state):
    stage_new(state, receive_count=2, now=1.0)
    state.fetch("r", 0, 2.0)
    assert state.next_deadline() == 11.0
    assert state.expire_due(10.9) == []
    assert [e.req_id for e in state.expire_due(11.0)] == ["r"]
    with pytest.raises(Expired) as info:
        state.fetch("r", 1, 12.0)
    assert info.value.details["received_ranks"] == [0]
    assert state.stats(12.0)["expired_total"] == 1 and state.stats(12.0)["live_refs"] == 0


def test_pending_entry_expires_after_encode_timeout_and_late_result_is_dropped(state):
    entry, _ = state.accept("r", "d", 1, 0.0)
    assert state.next_deadline() == 5.0
    assert [e.req_id for e in state.expire_due(5.0)] == ["r"]
    assert state.stage(entry, staged_items(), 6.0) is False
    assert state.fail(entry, EncodeFailed("boom", "r"), 6.0) is False
    assert state.get("r", 6.0).state == "expired"
    assert state.stats(6.0)["staged"] == 0


def test_cancel_pending_and_staged(state):
    pending, _ = state.accept("p", "d", 1, 0.0)
    assert state.cancel("p", 1.0).state == "cancelled"
    assert state.stage(pending, staged_items(), 2.0) is False  # encode finished after cancel: dropped
    stage_new(state, "s", receive_count=2)
    assert state.cancel("s", 1.0).state == "cancelled"
    with pytest.raises(Cancelled):
        state.fetch("s", 0, 2.0)
    assert state.cancel("s", 3.0).state == "cancelled"  # idempotent
    with pytest.raises(UnknownRequest):
        state.cancel("never", 0.0)
    assert state.stats(3.0)["cancelled_total"] == 2


def test_failed_entry_reports_cause_and_can_be_retried(state):
    entry, _ = state.accept("r", "d", 2, 0.0)
    assert state.fail(entry, InvalidRequest("items[0]: not an image", "r"), 1.0)
    with pytest.raises(EncodeFailed) as info:
        state.fetch("r", 0, 2.0)
    assert info.value.details["cause"] == {"code": "invalid_request", "message": "items[0]: not an image"}
    described = state.get("r", 2.0).describe()
    assert described["state"] == "failed" and described["error"]["code"] == "invalid_request"
    entry, created = state.accept("r", "d2", 2, 3.0)
    assert created and entry.state == "pending"


def test_a_staged_entry_lost_with_its_node_tells_every_later_rank_and_frees_its_refs(state):
    stage_new(state, receive_count=3)
    state.fetch("r", 0, 1.0)
    assert state.lose("r", Unavailable("lost: the node holding them died", "r"), 2.0)
    for rank in (0, 1):  # the rank that had it too: the entry is over
        with pytest.raises(Unavailable, match="node holding them died"):
            state.fetch("r", rank, 3.0)
    assert state.get("r", 3.0).state == "failed"
    assert (state.stats(3.0)["live_refs"], state.stats(3.0)["staged_bytes"]) == (0, 0)
    assert not state.lose("r", Unavailable("again", "r"), 4.0)  # ended: nothing changes
    entry, _ = state.accept("p", "d", 1, 5.0)
    assert not state.lose("p", Unavailable("pending has no objects yet", "p"), 5.0)
    assert entry.state == "pending"
    assert state.accept("r", "d", 3, 6.0)[1]  # it can be encoded again


def test_a_stale_result_never_lands_in_a_newer_entry_of_the_same_req_id(state):
    old, _ = state.accept("r", "d", 1, 0.0)
    state.cancel("r", 1.0)
    new, created = state.accept("r", "d", 1, 2.0)  # encoded afresh after the cancel
    assert created and new is not old
    assert state.stage(old, staged_items(), 3.0) is False  # the first attempt's result arrives late
    assert state.get("r", 3.0).state == "pending"
    assert state.stage(new, staged_items(), 4.0) and state.stage(new, staged_items(), 4.0) is False


def test_released_req_id_cannot_be_reused(state):
    stage_new(state, receive_count=1)
    state.fetch("r", 0, 1.0)
    with pytest.raises(AlreadyReleased):
        state.accept("r", "d", 1, 2.0)


def test_terminal_states_never_change(state):
    stage_new(state, receive_count=1)
    state.fetch("r", 0, 1.0)
    entry = state.get("r", 1.0)
    for target in ("staged", "pending", "expired", "cancelled"):
        with pytest.raises(IllegalTransition):
            state._move(entry, target)
    assert entry.state == "released"


def test_tombstones_bounded_by_count_and_age(state):
    for i in range(5):
        stage_new(state, f"r{i}", receive_count=1, now=float(i))
        state.fetch(f"r{i}", 0, float(i))
    assert state.stats(5.0)["tombstones"] == 3
    with pytest.raises(UnknownRequest):  # oldest dropped first
        state.get("r0", 5.0)
    assert state.get("r4", 5.0).state == "released"
    assert state.stats(200.0)["tombstones"] == 0
    assert state.fetch("r4", 0, 200.0) is None  # aged out: unknown again


def test_stats_track_staged_bytes_and_refs(state):
    stage_new(state, "a", receive_count=1, n=2)
    state.accept("b", "d", 1, 0.0)
    stats = state.stats(0.0)
    assert (stats["pending"], stats["staged"], stats["staged_bytes"], stats["live_refs"]) == (1, 1, 200, 2)
    state.fetch("a", 0, 1.0)
    stats = state.stats(1.0)
    assert (stats["staged"], stats["staged_bytes"], stats["live_refs"], stats["released_total"]) == (0, 0, 0, 1)


def test_describe_lists_items_and_ranks(state):
    stage_new(state, receive_count=2)
    state.fetch("r", 1, 1.0)
    out = state.get("r", 1.0).describe()
    assert out["state"] == "staged" and out["received_ranks"] == [1]
    assert [m["index"] for m in out["items"]] == [0, 1] and out["items"][0]["nbytes"] == 100
    pickle.dumps(out)  # crosses process boundaries as plain data


def test_failed_entry_keeps_no_traceback_of_the_failure(state):
    entry, _ = state.accept("r", "d", 1, 0.0)

    def failing_call():
        big_local = bytearray(10**6)  # what a traceback would pin
        raise InvalidRequest("items[0]: bad", "r")

    try:
        failing_call()
    except InvalidRequest as raised:
        state.fail(entry, raised, 1.0)
    stored = state.get("r", 1.0).error
    assert stored.message == "items[0]: bad" and stored.__traceback__ is None and stored.__context__ is None


def test_admission_refuses_new_requests_past_max_pending_but_answers_retries():
    state = RegistryState(limits(max_pending_requests=2))
    first, _ = state.accept("a", "d", 1, 0.0)
    state.accept("b", "d", 1, 0.0)
    with pytest.raises(Overloaded) as info:
        state.accept("c", "d", 1, 0.0)
    assert "max_pending_requests=2" in info.value.message and info.value.details == {"retry_after_s": 1}
    assert state.accept("a", "d", 1, 0.0) == (first, False)  # a retry is not a new request
    state.stage(first, staged_items(1), 1.0)
    assert state.accept("c", "d", 1, 1.0)[1]  # room again
    with pytest.raises(UnknownRequest):
        state.get("never-admitted", 1.0)


def test_admission_projects_staged_bytes_over_pending_requests():
    state = RegistryState(limits(max_staged_bytes=500))
    stage_new(state, "a", receive_count=1, n=2)  # 200 bytes staged; mean entry 200
    stage_new(state, "b", receive_count=1, n=2)  # 400
    state.accept("c", "d", 1, 0.0)  # 400 + 0 pending < 500: admitted, now pending
    with pytest.raises(Overloaded, match="max_staged_bytes"):
        state.accept("d", "d", 1, 0.0)  # 400 + 1 pending x 200 >= 500
    state.fetch("a", 0, 1.0)  # released: 200 staged + 200 projected < 500
    assert state.accept("d", "d", 1, 1.0)[1]


def test_state_of_follows_every_state_and_ages_out_to_unknown(state):
    assert state.state_of("r", 0.0) == "unknown"
    entry, _ = state.accept("r", "d", 2, 0.0)
    assert state.state_of("r", 0.0) == "pending"
    state.stage(entry, staged_items(1), 1.0)
    assert state.state_of("r", 1.0) == "staged"
    state.fetch("r", 0, 1.0)
    assert state.state_of("r", 1.0) == "staged"
    state.fetch("r", 1, 1.0)
    assert state.state_of("r", 1.0) == "released"
    stage_new(state, "c")
    state.cancel("c", 2.0)
    assert state.state_of("c", 2.0) == "cancelled"
    stage_new(state, "e", now=2.0)
    state.expire_due(20.0)
    assert state.state_of("e", 20.0) == "expired"
    assert state.state_of("r", 200.0) == "unknown"  # its tombstone aged out


def test_an_uncounted_fetch_returns_the_items_and_leaves_the_rank_uncounted(state):
    stage_new(state, receive_count=1)
    peeked = state.fetch("r", 0, 1.0, count=False)
    assert peeked is not None and not peeked.released and len(peeked.items) == 2
    assert state.get("r", 1.0).received == {} and state.state_of("r", 1.0) == "staged"
    with pytest.raises(InvalidRank):
        state.fetch("r", 1, 1.0, count=False)  # the same checks as a counted fetch
    assert state.fetch("r", 0, 2.0).released  # the acknowledgement: counted, released
    with pytest.raises(AlreadyReleased):
        state.fetch("r", 0, 3.0, count=False)


def test_listing_pages_in_req_id_order_over_entries_and_tombstones(state):
    for req_id in ("c", "a", "e"):
        stage_new(state, req_id=req_id, receive_count=1)
    state.accept("b", "d", 1, 0.0)  # pending
    state.fetch("a", 0, 1.0)  # released: a tombstone
    page, more = state.list_entries(None, None, 2, 1.0)
    assert [(e.req_id, e.state) for e in page] == [("a", "released"), ("b", "pending")] and more
    page, more = state.list_entries(None, "b", 2, 1.0)
    assert [e.req_id for e in page] == ["c", "e"] and not more
    page, more = state.list_entries("staged", None, 10, 1.0)
    assert [e.req_id for e in page] == ["c", "e"] and not more
    assert state.list_entries("expired", None, 10, 1.0) == ([], False)


@pytest.mark.parametrize(
    "changed",
    [{"tombstone_ttl_s": 0}, {"max_tombstones": 0}, {"max_tombstones": 2}],
    ids=["no-tombstone-age", "no-tombstones", "more-expiries-in-a-tick-than-tombstones"],
)
def test_expire_due_returns_every_entry_it_ended_even_when_its_tombstone_is_gone(changed):
    state = RegistryState(limits(ttl_s=10, encode_timeout_s=5, **changed))
    for i in range(4):
        stage_new(state, f"r{i}", now=0.0)
        state.fetch(f"r{i}", 0, 1.0)
    expired = state.expire_due(10.0)  # all four in one tick
    assert [(e.req_id, e.state, sorted(e.received)) for e in expired] == [(f"r{i}", "expired", [0]) for i in range(4)]
    assert state.stats(10.0)["expired_total"] == 4 and state.stats(10.0)["tombstones"] <= changed.get("max_tombstones", 4)


def test_admission_counts_the_media_pending_requests_hold_until_their_encode_ends():
    state = RegistryState(limits(max_pending_input_bytes=1000))
    big, _ = state.accept("big", "d", 1, 0.0, input_bytes=5000)  # alone: always admitted
    with pytest.raises(Overloaded, match="max_pending_input_bytes"):
        state.accept("next", "d", 1, 0.0, input_bytes=1)
    assert state.stats(0.0)["pending_input_bytes"] == 5000
    assert state.stage(big, staged_items(), 1.0)  # its encode ended: its media let go
    first, _ = state.accept("first", "d", 1, 1.0, input_bytes=600)
    with pytest.raises(Overloaded):
        state.accept("second", "d", 1, 1.0, input_bytes=600)
    state.accept("third", "d", 1, 1.0, input_bytes=300)
    assert state.accept("first", "d", 1, 1.0, input_bytes=600)[1] is False  # a retry is always answered
    assert state.fail(first, Overloaded("x", "first"), 2.0)
    state.accept("second", "d", 1, 2.0, input_bytes=600)
    assert state.stats(2.0)["pending_input_bytes"] == 900
