"""Ranks known by their endpoint (SGLang's protocol): ``claim`` and ``refuse`` on the
lifecycle, driven with a fake clock (no Ray)."""

import pytest

from deployments.config import AppConfig
from registry.errors import AlreadyReleased, EncodeFailed, Expired, InvalidRank, InvalidRequest
from registry.server.state import OPEN, RegistryState, StagedItem


@pytest.fixture
def state():
    limits = AppConfig(ttl_s=10, encode_timeout_s=5, max_receive_count=8, tombstone_ttl_s=100, max_tombstones=3).limits()
    return RegistryState(limits)


def stage(state, entry, now=0.0):
    assert state.stage(entry, [StagedItem({"shape": [4, 8], "dtype": "float32", "nbytes": 128}, "ref0")], now)


def test_the_first_claim_fixes_an_open_count_and_each_endpoint_is_one_rank(state):
    entry, _ = state.accept("p", "d", OPEN, 0.0)
    with pytest.raises(InvalidRank, match="no receive_count yet"):
        state.fetch("p", 0, 0.0)
    assert state.claim("p", "tcp://127.0.0.1:1", 2, 0.0) == 0
    assert entry.receive_count == 2
    assert state.claim("p", "tcp://127.0.0.1:1", 2, 0.1) == 0  # a repeat: the same rank
    assert state.claim("p", "tcp://127.0.0.1:2", 2, 0.2) == 1
    with pytest.raises(InvalidRank, match="one too many"):
        state.claim("p", "tcp://127.0.0.1:3", 2, 0.3)
    stage(state, entry)
    assert not state.fetch("p", 0, 1.0).released
    assert state.fetch("p", 1, 1.0).released
    with pytest.raises(AlreadyReleased):
        state.claim("p", "tcp://127.0.0.1:3", 2, 2.0)


def test_claims_may_come_before_the_accept_and_must_agree_on_the_count(state):
    assert state.claim("q", "tcp://127.0.0.1:1", 2, 0.0) is None  # unknown: the caller waits
    entry, _ = state.accept("q", "d", OPEN, 0.1)
    assert state.claim("q", "tcp://127.0.0.1:1", 2, 0.2) == 0
    with pytest.raises(InvalidRequest, match="Inconsistent receive_count"):
        state.claim("q", "tcp://127.0.0.1:2", 4, 0.3)
    with pytest.raises(InvalidRequest, match="between 1 and 8"):
        state.claim("q", "tcp://127.0.0.1:2", 0, 0.3)
    assert entry.endpoints == {"tcp://127.0.0.1:1": 0}


def test_a_retry_of_an_open_request_joins_it_after_its_count_was_fixed(state):
    entry, _ = state.accept("r", "d", OPEN, 0.0)
    state.claim("r", "tcp://127.0.0.1:1", 2, 0.1)
    assert state.accept("r", "d", OPEN, 0.2) == (entry, False)


def test_an_open_entry_nobody_claims_expires_on_its_ttl(state):
    entry, _ = state.accept("s", "d", OPEN, 0.0)
    stage(state, entry, 1.0)
    assert [e.req_id for e in state.expire_due(11.5)] == ["s"]
    with pytest.raises(Expired):
        state.claim("s", "tcp://127.0.0.1:1", 2, 12.0)


def test_a_refusal_leaves_a_failed_tombstone_that_claims_and_fetches_see(state):
    assert state.refuse("t", InvalidRequest("items[0]: not an image", "t"), 0.0)
    with pytest.raises(EncodeFailed, match=r"\[invalid_request\] items\[0\]: not an image"):
        state.claim("t", "tcp://127.0.0.1:1", 2, 0.1)
    with pytest.raises(EncodeFailed):
        state.fetch("t", 0, 0.1)
    assert state.stats(0.1)["failed_total"] == 1
    # A known req_id keeps its own record; a refused one may be encoded afresh.
    assert not state.refuse("t", InvalidRequest("again", "t"), 0.2)
    entry, created = state.accept("t", "d", 1, 0.3)
    assert created and not state.refuse("t", InvalidRequest("live", "t"), 0.4)
