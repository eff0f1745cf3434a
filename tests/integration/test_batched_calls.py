"""Batched calls on the encode path: items that reach the registry together share one Encoder
call, wait=false requests that reach the Ingress together share one registry call, and each
result, answer and error stays its own."""

import hashlib

import pytest
import ray
from ray import serve

from encoder import EncodedItem
from registry import lookup_shards, media_input
from registry.errors import InvalidRequest, UnknownRequest
from support import MODEL_SPEC, image_bytes, image_item, reference_embedding, registry_stats


def _sha(data: bytes) -> str:
    return hashlib.sha256(reference_embedding(data, **MODEL_SPEC).tobytes()).hexdigest()


def _delta(after: dict, before: dict, *keys: str) -> tuple[int, ...]:
    return tuple(after[key] - before[key] for key in keys)


def test_the_items_of_a_request_share_one_encoder_call_and_each_stays_its_own_object(cluster):
    # Three inline items and one stored in the object store (passed to the replica unread).
    images = [image_bytes(64, 64, seed=7100 + i) for i in range(3)] + [image_bytes(224, 224, seed=7103)]
    before = registry_stats()
    body = {"req_id": "shared-call", "receive_count": 2, "items": [image_item(d) for d in images]}
    out = cluster.http.post("/v1/encode", json=body)
    assert out.status_code == 200 and out.json()["state"] == "staged"
    staged = registry_stats()
    assert _delta(staged, before, "encoder_calls_total", "encoder_call_items_total") == (1, 4)
    assert _delta(staged, before, "live_refs") == (4,)  # four objects, one per item
    got = ray.get([cluster.ranks[rank].fetch.remote("shared-call", digests=True) for rank in (0, 1)])
    assert got[0]["bytes"] == got[1]["bytes"] == [_sha(d) for d in images]
    assert [meta["nbytes"] for meta in got[0]["metas"]] == [len(reference_embedding(d, **MODEL_SPEC).tobytes()) for d in images]
    assert cluster.http.get("/v1/requests/shared-call").json()["state"] == "released"


def test_encode_many_streams_each_items_result_or_its_own_error_in_order(cluster):
    encoder = serve.get_deployment_handle("Encoder", app_name="epd").options(stream=True)
    good, large = image_bytes(64, 64, seed=7110), image_bytes(224, 224, seed=7111)
    stored = ray.put(large)  # inside a list, so the replica reads it itself
    out = list(encoder.encode_many.remote([good, b"not an image", stored], ["many-0", "many-1", "many-2"]))
    assert [type(value) for value in out] == [EncodedItem, InvalidRequest, EncodedItem]
    assert out[0].payload.tobytes() == reference_embedding(good, **MODEL_SPEC).tobytes()
    assert out[2].payload.tobytes() == reference_embedding(large, **MODEL_SPEC).tobytes()
    assert out[1].code == "invalid_request" and "image" in out[1].message
    with pytest.raises(InvalidRequest, match="a list of media"):
        list(encoder.encode_many.remote("not a list", []))
    del out, stored


def test_submit_many_answers_each_request_alone(cluster):
    shards = lookup_shards()
    req_ids = [f"many-submit-{i}" for i in range(64)]
    shard, mine = next((shard, ids) for shard, ids in shards.group(req_ids).items() if len(ids) >= 2)
    (first, refused), elsewhere = mine[:2], next(r for r in req_ids if shards.index(r) != shard)
    data = image_bytes(48, 48, seed=7120)
    item = media_input(data)
    before = registry_stats()
    requests = [
        (first, [item], "digest-first", 1),
        (refused, [item], "digest-refused", -1),  # receive_count out of range (0 is OPEN: its ranks set it)
        (elsewhere, [item], "digest-elsewhere", 1),  # not this shard's
        (first, [item], "digest-first", 1),  # a retry joins the live entry
        ("malformed",),
    ]
    out = ray.get(shards.handles[shard].submit_many.remote(requests))
    assert out[0]["req_id"] == out[3]["req_id"] == first and out[0]["state"] in ("pending", "staged")
    assert [(type(o), o.req_id) for o in out[1:3]] == [(InvalidRequest, refused), (InvalidRequest, elsewhere)]
    assert "receive_count" in out[1].message and f"belongs to shard {shards.index(elsewhere)}" in out[2].message
    assert isinstance(out[4], InvalidRequest) and "(req_id, items, digest, receive_count)" in out[4].message
    assert _delta(registry_stats(), before, "submit_calls_total", "submitted_requests_total") == (1, 5)
    with pytest.raises(InvalidRequest, match="a list"):
        ray.get(shards.handles[shard].submit_many.remote("not a list"))

    assert ray.get(cluster.ranks[0].fetch.remote(first, digests=True))["bytes"] == [_sha(data)]
    for req_id in (refused, elsewhere):  # nothing was created for them
        with pytest.raises(UnknownRequest):
            ray.get(shards.of(req_id).describe.remote(req_id))


def test_wait_false_requests_that_arrive_together_share_registry_calls(cluster):
    handle = serve.get_app_handle("epd")
    images = [image_bytes(40, 40, seed=7200 + i) for i in range(32)]
    before = registry_stats()
    responses = [
        handle.encode.remote({"req_id": f"burst-{i}", "receive_count": 1, "wait": False, "items": [image_item(d)]})
        for i, d in enumerate(images)
    ]
    out = [response.result(timeout_s=60) for response in responses]
    assert [o["req_id"] for o in out] == [f"burst-{i}" for i in range(32)]
    assert all(o["state"] in ("pending", "staged") for o in out)
    calls, requests = _delta(registry_stats(), before, "submit_calls_total", "submitted_requests_total")
    assert requests == 32 and calls < requests  # several requests rode in one call
    got = ray.get([cluster.ranks[0].fetch.remote(f"burst-{i}", digests=True) for i in range(32)])
    assert [g["bytes"] for g in got] == [[_sha(d)] for d in images]
