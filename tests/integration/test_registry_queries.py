"""What decoders other than a plain fetch need: an acknowledgement that reads no bytes,
a batched state query, and a long-poll watch of many entries."""

import time
import uuid

import pytest
import ray

from registry import EmbeddingReceiver, lookup_registry, lookup_shards
from registry.errors import AlreadyReleased, InvalidRank, InvalidRequest
from support import image_bytes, image_item


def new_id():
    return f"q-{uuid.uuid4().hex[:12]}"


def encode(cluster, seed, receive_count=2, req_id=None, wait=True):
    body = {"req_id": req_id or new_id(), "receive_count": receive_count, "items": [image_item(image_bytes(64, 64, seed=seed))], "wait": wait}
    response = cluster.http.post("/v1/encode", json=body)
    assert response.status_code in (200, 202), response.text
    return response.json()["req_id"]


def test_an_acknowledgement_counts_the_rank_like_a_fetch_and_reads_nothing(cluster):
    req_id = encode(cluster, seed=501)
    fetched = ray.get(cluster.ranks[0].fetch.remote(req_id))
    assert "error" not in fetched
    registry = lookup_registry(req_id=req_id)
    assert ray.get(registry.states.remote([req_id])) == {req_id: "staged"}
    acked = ray.get(registry.acknowledge.remote(req_id, 1))
    assert acked == {"req_id": req_id, "rank": 1, "released": True}
    described = cluster.http.get(f"/v1/requests/{req_id}").json()
    assert described["state"] == "released" and described["received_ranks"] == [0, 1]
    with pytest.raises(AlreadyReleased):
        EmbeddingReceiver(rank=1).acknowledge(req_id)


def test_a_repeated_acknowledgement_does_not_release_early(cluster):
    req_id = encode(cluster, seed=502)
    receiver = EmbeddingReceiver(rank=0)
    assert receiver.acknowledge(req_id) is False
    assert receiver.acknowledge(req_id) is False  # counted once
    assert cluster.http.get(f"/v1/requests/{req_id}").json()["received_ranks"] == [0]
    with pytest.raises(InvalidRank):
        EmbeddingReceiver(rank=2).acknowledge(req_id)
    assert EmbeddingReceiver(rank=1).acknowledge(req_id) is True


def test_states_answers_many_req_ids_in_one_call(cluster):
    shards = lookup_shards()
    # One req_id of another shard than 0 for the refusal below, whichever shards the others land on.
    never = next(r for r in iter(new_id, None) if shards.index(r) != 0)
    staged, cancelled = encode(cluster, seed=503), encode(cluster, seed=504)
    assert cluster.http.delete(f"/v1/requests/{cancelled}").status_code == 200
    assert shards.states([staged, cancelled, never]) == {staged: "staged", cancelled: "cancelled", never: "unknown"}
    # One call per shard: each answers for its own req_ids, and refuses another's.
    groups = shards.group([staged, cancelled, never])
    for shard, req_ids in groups.items():
        assert ray.get(shards.handles[shard].states.remote(req_ids)) == {r: shards.states([r])[r] for r in req_ids}
    with pytest.raises(InvalidRequest, match=f"belongs to shard {shards.index(never)}"):
        ray.get(shards.handles[0].states.remote([never]))
    with pytest.raises(InvalidRequest):
        ray.get(shards.handles[0].states.remote("not-a-list"))
    assert cluster.http.delete(f"/v1/requests/{staged}").status_code == 200


def test_watch_returns_at_once_for_a_difference_and_wakes_on_a_change(cluster):
    req_id = new_id()
    registry = lookup_registry(req_id=req_id)
    # What the caller does not know yet is answered at once.
    assert ray.get(registry.watch.remote({req_id: None}, 5.0)) == {req_id: "unknown"}
    # Nothing differs: the call waits until the entry changes.
    started = time.monotonic()
    waiting = registry.watch.remote({req_id: "unknown"}, 30.0)
    ready, _ = ray.wait([waiting], timeout=0.5)
    assert not ready
    encode(cluster, seed=505, req_id=req_id, wait=False)
    changed = ray.get(waiting, timeout=30)
    assert changed[req_id] in ("pending", "staged")
    assert time.monotonic() - started < 25
    # And once nothing changes, it answers {} after its timeout.
    state = ray.get(registry.states.remote([req_id]))[req_id]
    if state == "pending":
        assert ray.get(registry.watch.remote({req_id: "pending"}, 30.0))[req_id] == "staged"
    assert ray.get(registry.watch.remote({req_id: "staged"}, 0.2)) == {}
    assert cluster.http.delete(f"/v1/requests/{req_id}").status_code == 200
