"""The sharded registry (the suite's app runs 4 shards): routing, batched fetches, a shard's loss."""

from __future__ import annotations

import hashlib
import uuid

import pytest
import ray

from deployments import AppConfig
from registry import EmbeddingReceiver, RegistryError, get_or_create_shards, lookup_shards
from registry.errors import InvalidRequest
from support import MODEL_SPEC, image_bytes, image_item, reference_embedding, registry_stats, wait_until


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def encode(cluster, seed: int, req_id: str, receive_count: int = 2, wait: bool = True) -> dict:
    body = {"req_id": req_id, "receive_count": receive_count, "items": [image_item(image_bytes(64, 64, seed=seed))],
            "wait": wait}
    response = cluster.http.post("/v1/encode", json=body)
    assert response.status_code in (200, 202), response.text
    return response.json()


def ids_on_every_shard(shards, prefix: str, per_shard: int = 2) -> list[str]:
    """Fresh req_ids, ``per_shard`` of them held by each shard."""
    found: dict[int, list[str]] = {i: [] for i in range(len(shards))}
    while any(len(ids) < per_shard for ids in found.values()):
        req_id = new_id(prefix)
        if len(found[shards.index(req_id)]) < per_shard:
            found[shards.index(req_id)].append(req_id)
    return [req_id for ids in found.values() for req_id in ids]


def _raw(tensor) -> bytes:
    import torch

    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def test_the_app_runs_the_configured_shards_and_stats_sum_over_them(cluster):
    shards = lookup_shards()
    assert len(shards) == cluster.app_args["registry_shards"] == 4
    pings = ray.get([handle.ping.remote() for handle in shards.handles])
    assert [p["shard"] for p in pings] == [0, 1, 2, 3] and {p["shards"] for p in pings} == {4}
    assert len({p["pid"] for p in pings}) == 4  # four processes
    health = cluster.http.get("/health").json()
    assert health["registry"]["shard_pids"] == [p["pid"] for p in pings]
    # An entry is held by its own shard only, and /v1/stats counts it once.
    req_id = new_id("one")
    encode(cluster, 700, req_id, receive_count=1)
    held = [ray.get(h.stats.remote())["staged"] for h in shards.handles]
    assert held[shards.index(req_id)] == 1 and sum(held) == 1
    assert cluster.http.get("/v1/stats").json()["staged"] == registry_stats()["staged"] == 1
    assert cluster.http.delete(f"/v1/requests/{req_id}").status_code == 200


def test_a_redeploy_asking_for_another_shard_count_keeps_the_running_one(cluster):
    # Which shard holds a req_id follows from the count: changing it under live entries
    # would strand them, so the count is fixed when the registry is created.
    settings = AppConfig.model_validate({**cluster.app_args, "registry_shards": 2}).registry_settings("epd")
    shards = get_or_create_shards(settings)
    assert len(shards) == 4 and shards.settings.registry_shards == 4
    assert [ping["shard"] for ping in ray.get([h.ping.remote() for h in shards.handles])] == [0, 1, 2, 3]
    assert len(lookup_shards()) == 4


def test_a_call_sent_to_the_wrong_shard_is_refused_and_creates_nothing(cluster):
    shards = lookup_shards()
    req_id = next(r for r in (new_id("wrong") for _ in range(100)) if shards.index(r) != 0)
    with pytest.raises(InvalidRequest, match=f"belongs to shard {shards.index(req_id)}"):
        ray.get(shards.handles[0].fetch.remote(req_id, 0, 0.0))
    with pytest.raises(InvalidRequest):
        ray.get(shards.handles[0].watch.remote({req_id: None}, 0.0))
    assert registry_stats()["pending"] == 0


def test_fetch_many_returns_each_request_s_items_or_its_error_by_the_same_rules(cluster):
    shards = lookup_shards()
    staged = ids_on_every_shard(shards, "many")
    for i, req_id in enumerate(staged):
        encode(cluster, 710 + i, req_id)
    never, released = new_id("never"), new_id("released")
    encode(cluster, 730, released, receive_count=1)
    EmbeddingReceiver(rank=0).fetch(released)
    batch = staged + [never, released, staged[0]]  # a repeat is answered once

    first = EmbeddingReceiver(rank=0).fetch_many(batch, timeout_s=0.5)
    assert list(first) == staged + [never, released]
    expected = {req_id: [reference_embedding(image_bytes(64, 64, seed=710 + i), **MODEL_SPEC).tobytes()]
                for i, req_id in enumerate(staged)}
    for req_id in staged:
        assert [_raw(item.tensor) for item in first[req_id]] == expected[req_id]
        assert first[req_id][0].meta["index"] == 0
    assert first[never].code == "not_ready" and first[released].code == "already_released"
    # Rank 0 fetched them all and released none; rank 1's batch, on an event loop, releases them all.
    assert registry_stats()["staged"] == len(staged)
    second = ray.get(cluster.ranks[1].fetch_many.remote(staged + [never], 0.5))
    assert second[never] == "not_ready"
    assert {r: second[r] for r in staged} == {r: [hashlib.sha256(b).hexdigest() for b in expected[r]] for r in staged}
    for req_id in staged:
        assert cluster.http.get(f"/v1/requests/{req_id}").json()["state"] == "released"
    # A late rank gets already_released, per request.
    assert {v.code for v in EmbeddingReceiver(rank=1).fetch_many(staged[:2]).values()} == {"already_released"}


def test_acknowledge_many_counts_a_rank_for_each_request_or_says_why_not(cluster):
    shards = lookup_shards()
    staged = ids_on_every_shard(shards, "ack")
    for i, req_id in enumerate(staged):
        encode(cluster, 770 + i, req_id)  # receive_count 2
    never = new_id("never")
    rank0, rank1 = EmbeddingReceiver(rank=0), EmbeddingReceiver(rank=1)
    first = rank0.acknowledge_many(staged + [never, staged[0]])  # a repeat is answered once
    assert list(first) == staged + [never]
    assert [first[r] for r in staged] == [False] * len(staged) and first[never].code == "not_ready"
    assert rank1.acknowledge_many(staged) == dict.fromkeys(staged, True)  # the last rank releases each
    for req_id in staged:
        described = cluster.http.get(f"/v1/requests/{req_id}").json()
        assert described["state"] == "released" and described["received_ranks"] == [0, 1]
    assert {v.code for v in rank1.acknowledge_many(staged[:2]).values()} == {"already_released"}


def test_fetch_many_waits_for_pending_requests(cluster):
    req_ids = [new_id("wait") for _ in range(3)]
    batch = cluster.ranks[0].fetch_many.remote(req_ids, 60.0)
    for i, req_id in enumerate(req_ids):
        encode(cluster, 740 + i, req_id, receive_count=1, wait=False)
    got = ray.get(batch, timeout=90)
    assert all(isinstance(got[r], list) and len(got[r]) == 1 for r in req_ids), got
    wait_until(lambda: registry_stats()["staged"] == 0, 10, what="all three released by their one rank")


@pytest.mark.slow
def test_a_shard_s_death_loses_only_its_own_entries(cluster):
    shards = lookup_shards()
    req_ids = ids_on_every_shard(shards, "death", per_shard=1)
    for i, req_id in enumerate(req_ids):
        encode(cluster, 750 + i, req_id, receive_count=1)
    victim = shards.index(req_ids[1])
    ray.kill(shards.handles[victim], no_restart=False)  # Ray restarts it, empty: its objects died with it
    got = EmbeddingReceiver(rank=0).fetch_many(req_ids, timeout_s=30)
    lost = got.pop(req_ids[1])
    assert isinstance(lost, RegistryError) and lost.code == "unavailable", lost
    assert all(isinstance(items, list) and len(items) == 1 for items in got.values()), got
    # The restarted shard serves new requests; the others never noticed.
    fresh = next(r for r in (new_id("after") for _ in range(200)) if shards.index(r) == victim)
    body = {"req_id": fresh, "receive_count": 1, "items": [image_item(image_bytes(64, 64, seed=760))]}
    # While Ray brings it back, calls to it are answered 503 unavailable: a client retries.
    wait_until(lambda: cluster.http.post("/v1/encode", json=body).status_code == 200, 30, what="the shard to serve again")
    assert len(EmbeddingReceiver(rank=0).fetch(fresh)) == 1
