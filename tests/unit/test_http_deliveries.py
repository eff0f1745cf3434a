"""The lifecycle's rule for ranks sent their items over HTTP (``RegistryState.deliver``): a
rank is counted at its acknowledgement or ``http_pull_grace_s`` after its last pull, never at
the pull itself, and the ttl does not expire an entry whose every rank is counted or in its
grace. Driven with a fake clock, no Ray."""

import pytest

from deployments.config import AppConfig
from registry.errors import AlreadyReleased, InvalidRank
from registry.server.state import RegistryState, StagedItem

GRACE, TTL = 4.0, 10.0


@pytest.fixture
def state():
    return RegistryState(AppConfig(ttl_s=TTL, http_pull_grace_s=GRACE, tombstone_ttl_s=100).limits())


def staged(state, receive_count, now=0.0, req_id="r"):
    entry, _ = state.accept(req_id, "d", receive_count, now)
    assert state.stage(entry, [StagedItem({"nbytes": 10}, "ref")], now)
    return entry


def test_a_pull_is_not_counted_its_repeat_is_answered_and_the_acknowledgement_counts(state):
    staged(state, 1)
    first = state.deliver("r", 0, 1.0)
    assert first is not None and not first.released and len(first.items) == 1
    entry = state.get("r", 1.0)
    assert entry.received == {} and entry.delivering == {0: 1.0 + GRACE}
    assert entry.describe()["delivering_ranks"] == [0] and entry.describe()["received_ranks"] == []
    again = state.deliver("r", 0, 2.0)  # the first one did not arrive: the same items, a new grace
    assert again.items == first.items and state.get("r", 2.0).delivering == {0: 2.0 + GRACE}
    assert state.fetch("r", 0, 3.0).released  # the acknowledgement
    assert state.get("r", 3.0).state == "released" and state.get("r", 3.0).delivering == {}
    with pytest.raises(AlreadyReleased):
        state.deliver("r", 0, 4.0)


def test_a_rank_that_never_acknowledges_is_counted_when_its_grace_ends(state):
    staged(state, 2)
    state.deliver("r", 0, 1.0)
    state.deliver("r", 1, 2.0)
    assert state.next_deadline() == 1.0 + GRACE
    assert state.expire_due(1.0 + GRACE - 0.1) == []
    assert state.expire_due(1.0 + GRACE) == [] and sorted(state.get("r", 5.0).received) == [0]
    assert state.next_deadline() == 2.0 + GRACE
    ended = state.expire_due(2.0 + GRACE)
    assert [(e.req_id, e.state) for e in ended] == [("r", "released")]
    assert state.stats(7.0)["released_total"] == 1 and state.stats(7.0)["live_refs"] == 0


def test_a_counted_rank_pulling_again_is_a_repeated_fetch(state):
    staged(state, 2)
    assert not state.fetch("r", 0, 1.0).released  # a Ray rank, counted at once
    assert state.deliver("r", 0, 2.0) is not None
    assert state.get("r", 2.0).delivering == {} and state.next_deadline() == TTL
    with pytest.raises(InvalidRank):
        state.deliver("r", 2, 2.0)  # the same checks as a fetch


def test_the_ttl_waits_for_ranks_in_their_grace_but_expires_an_entry_a_rank_never_came_for(state):
    staged(state, 2, req_id="all")
    staged(state, 3, req_id="missing")
    for req_id in ("all", "missing"):
        state.fetch(req_id, 0, 1.0)
        state.deliver(req_id, 1, TTL - 1.0)
    ended = state.expire_due(TTL)
    assert [(e.req_id, e.state) for e in ended] == [("missing", "expired")]  # rank 2 never pulled
    assert state.get("all", TTL).state == "staged"  # every rank counted or in its grace
    assert state.deliver("all", 1, TTL + 2.0) is not None  # pulled again past the ttl: the grace is capped
    assert state.get("all", TTL + 2.0).delivering == {1: TTL + GRACE}
    ended = state.expire_due(TTL + GRACE)
    assert [(e.req_id, e.state) for e in ended] == [("all", "released")]
    assert state.get("missing", TTL).describe()["delivering_ranks"] == [1]  # the tombstone says who was sent it


def test_a_grace_of_zero_counts_the_rank_at_the_next_tick(state):
    zero = RegistryState(AppConfig(ttl_s=TTL, http_pull_grace_s=0).limits())
    staged(zero, 1)
    zero.deliver("r", 0, 1.0)
    assert [(e.req_id, e.state) for e in zero.expire_due(1.0)] == [("r", "released")]
