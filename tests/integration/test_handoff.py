"""Encode over HTTP, fetch from TP-rank actors: the release rule and every fetch outcome."""

import time
import uuid

import numpy as np
import pytest
import ray
from ray import serve

from registry import lookup_registry
from registry.errors import InvalidRank, NotReady
from ray_readings import CycleWatch
from support import INLINE_OBJECT_LIMIT, MODEL_SPEC, RankActor, image_bytes, image_item, reference_embedding, registry_stats, wait_until


def new_id(prefix="r"):
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def encode(cluster, images, receive_count=None, req_id=None, wait=True, expect=200):
    body = {"req_id": req_id or new_id(), "items": [image_item(d) for d in images], "wait": wait}
    if receive_count is not None:
        body["receive_count"] = receive_count
    response = cluster.http.post("/v1/encode", json=body)
    assert response.status_code == expect, response.text
    return response.json()


def state_of(cluster, req_id):
    return cluster.http.get(f"/v1/requests/{req_id}").json()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_ranks_get_identical_bytes_equal_to_the_encoder_output(cluster, tp):
    images = [image_bytes(224, 160, seed=tp), image_bytes(64, 64, seed=tp + 10)]
    out = encode(cluster, images, receive_count=tp)
    assert out["state"] == "staged" and out["receive_count"] == tp
    assert [item["shape"] for item in out["items"]] == [[140, 512], [16, 512]]

    results = ray.get([rank.fetch.remote(out["req_id"]) for rank in cluster.ranks[:tp]])
    expected = [reference_embedding(d, **MODEL_SPEC).tobytes() for d in images]
    for result in results:
        assert "error" not in result, result
        assert result["dtypes"] == ["bfloat16", "bfloat16"]
        assert result["shapes"] == [[140, 512], [16, 512]]
        assert result["bytes"] == expected  # bitwise: every rank, and the encoder's own output
        assert [m["index"] for m in result["metas"]] == [0, 1]
        assert result["metas"][0]["mm_hash"] == out["items"][0]["mm_hash"]

    final = state_of(cluster, out["req_id"])
    assert final["state"] == "released" and final["received_ranks"] == list(range(tp))
    late = ray.get(cluster.ranks[0].fetch.remote(out["req_id"]))
    assert late["error"] == "already_released"
    assert late["details"]["received_ranks"] == list(range(tp))


def test_repeated_fetch_by_one_rank_does_not_release_and_is_zero_copy(cluster):
    out = encode(cluster, [image_bytes(224, 224, seed=3)], receive_count=2)
    # Objects over 100 KB live in the shared object store; smaller ones travel inline (copied).
    assert out["items"][0]["nbytes"] > INLINE_OBJECT_LIMIT
    rank0 = cluster.ranks[0]
    first = ray.get(rank0.fetch.remote(out["req_id"], hold=True))
    second = ray.get(rank0.fetch.remote(out["req_id"]))
    assert first["bytes"] == second["bytes"]
    # Both reads map the same object-store memory: no copy was made.
    assert first["data_ptrs"] == second["data_ptrs"]
    described = state_of(cluster, out["req_id"])
    assert described["state"] == "staged" and described["received_ranks"] == [0]
    assert "error" not in ray.get(cluster.ranks[1].fetch.remote(out["req_id"]))
    assert state_of(cluster, out["req_id"])["state"] == "released"
    # Released, yet rank 0 still holds its tensors: Ray's borrower counting keeps them alive.
    assert ray.get(rank0.drop.remote()) == 1


def test_blocking_receiver_api(cluster):
    out = encode(cluster, [image_bytes(64, 80, seed=4)], receive_count=1)
    digests = ray.get(cluster.ranks[0].fetch_sync.remote(out["req_id"]))
    assert len(digests) == 1 and len(digests[0]) == 64
    assert state_of(cluster, out["req_id"])["state"] == "released"


def test_rank_outside_receive_count_is_invalid_rank(cluster):
    out = encode(cluster, [image_bytes(64, 64, seed=5)], receive_count=2)
    result = ray.get(cluster.ranks[2].fetch.remote(out["req_id"]))
    assert result["error"] == "invalid_rank" and "ranks are 0..1" in result["message"]
    with pytest.raises(InvalidRank):
        ray.get(lookup_registry(req_id=out["req_id"]).fetch.remote(out["req_id"], -1, 1.0))
    assert state_of(cluster, out["req_id"])["received_ranks"] == []
    assert cluster.http.delete(f"/v1/requests/{out['req_id']}").json()["state"] == "cancelled"


def test_fetch_times_out_with_not_ready(cluster):
    start = time.monotonic()
    result = ray.get(cluster.ranks[0].fetch.remote(new_id("never"), timeout_s=0.5))
    elapsed = time.monotonic() - start
    assert result["error"] == "not_ready" and 0.5 <= elapsed < 5
    with pytest.raises(NotReady):
        ray.get(lookup_registry(req_id=(never := new_id("never"))).fetch.remote(never, 0, 0.0))


def test_fetch_waits_for_a_pending_request(cluster):
    req_id = new_id()
    waiting = [rank.fetch.remote(req_id, timeout_s=30) for rank in cluster.ranks[:2]]
    # Both ranks are waiting on a req_id nobody has sent yet.
    wait_until(lambda: registry_stats()["waiting_calls"] >= 2, 15, what="both ranks to be waiting")
    out = encode(cluster, [image_bytes(128, 128, seed=6)], receive_count=2, req_id=req_id, wait=False, expect=202)
    assert out["state"] == "pending"
    results = ray.get(waiting)
    assert all("error" not in r for r in results) and results[0]["bytes"] == results[1]["bytes"]
    assert state_of(cluster, req_id)["state"] == "released"


def test_get_with_wait_s_returns_once_staged(cluster):
    out = encode(cluster, [image_bytes(64, 64, seed=7)], receive_count=1, wait=False, expect=202)
    described = cluster.http.get(f"/v1/requests/{out['req_id']}", params={"wait_s": 20}).json()
    assert described["state"] == "staged"
    cluster.http.delete(f"/v1/requests/{out['req_id']}")


def test_cancel_drops_the_entry_and_fetches_say_cancelled(cluster):
    out = encode(cluster, [image_bytes(64, 64, seed=8)], receive_count=2)
    response = cluster.http.delete(f"/v1/requests/{out['req_id']}")
    assert response.status_code == 200 and response.json()["state"] == "cancelled"
    assert ray.get(cluster.ranks[0].fetch.remote(out["req_id"]))["error"] == "cancelled"
    assert state_of(cluster, out["req_id"])["state"] == "cancelled"
    assert cluster.http.delete(f"/v1/requests/{out['req_id']}").json()["state"] == "cancelled"


def test_same_req_id_with_other_items_is_conflict(cluster):
    out = encode(cluster, [image_bytes(64, 64, seed=9)], receive_count=1)
    clash = cluster.http.post(
        "/v1/encode", json={"req_id": out["req_id"], "receive_count": 1, "items": [image_item(image_bytes(64, 64, seed=10))]}
    )
    assert clash.status_code == 409 and clash.json()["error"]["code"] == "conflict"
    cluster.http.delete(f"/v1/requests/{out['req_id']}")


def test_retried_request_runs_the_model_once(cluster):
    encoder = serve.get_deployment_handle("Encoder", app_name="epd")
    before = encoder.stats.remote().result()["items_encoded"]
    req_id = new_id("retry")
    images = [image_bytes(80, 80, seed=11)]
    first = encode(cluster, images, receive_count=1, req_id=req_id)
    second = encode(cluster, images, receive_count=1, req_id=req_id)
    assert first["items"] == second["items"]
    assert encoder.stats.remote().result()["items_encoded"] == before + 1
    assert "error" not in ray.get(cluster.ranks[0].fetch.remote(req_id))
    # A retry after every rank received is refused, not counted as a new request.
    retry = cluster.http.post("/v1/encode", json={"req_id": req_id, "receive_count": 1, "items": [image_item(images[0])]})
    assert retry.status_code == 410 and retry.json()["error"]["code"] == "already_released"


def test_python_handle_takes_and_returns_the_http_shapes(cluster):
    from registry.errors import InvalidRequest, RegistryError

    handle = serve.get_app_handle("epd")
    out = handle.encode.remote({"items": [image_item(image_bytes(64, 64, seed=12))], "receive_count": 1}).result()
    assert out["state"] == "staged" and len(out["req_id"]) == 32 and out["items"][0]["dtype"] == "bfloat16"
    assert "error" not in ray.get(cluster.ranks[0].fetch.remote(out["req_id"]))
    with pytest.raises(RegistryError) as info:
        handle.encode.remote({"items": [{"type": "image", "image": "bm90IGFuIGltYWdl"}]}).result()
    assert isinstance(info.value, InvalidRequest) and info.value.code == "invalid_request"
    assert "items[0]" in info.value.message


def test_registry_stats_and_health(cluster):
    stats = cluster.http.get("/v1/stats").json()
    assert {"pending", "staged", "staged_bytes", "released_total", "expired_total"} <= set(stats)
    health = cluster.http.get("/health")
    assert health.status_code == 200 and health.json()["encoder"]["device"] == "cpu"
    # The replica holds a (fake) GPU from Ray, yet runs where torch can: the CPU.
    assert health.json()["encoder"]["cuda_visible_devices"] not in (None, "")
    assert cluster.http.get("/docs").status_code == 200
    paths = cluster.http.get("/openapi.json").json()["paths"]
    assert {"/v1/encode", "/v1/requests/{req_id}", "/v1/stats", "/health"} <= set(paths)
    assert registry_stats()["waiting_calls"] == 0


def test_embeddings_are_owned_by_the_registry_not_the_caller(cluster):
    out = encode(cluster, [image_bytes(64, 64, seed=13)], receive_count=1)
    stats = registry_stats()
    assert stats["live_refs"] >= 1 and stats["staged_bytes"] >= out["items"][0]["nbytes"]
    assert np.prod(out["items"][0]["shape"]) * 2 == out["items"][0]["nbytes"]
    assert "error" not in ray.get(cluster.ranks[0].fetch.remote(out["req_id"]))


def test_cancel_while_pending_never_stages(cluster):
    before = registry_stats()
    req_id = new_id("cancel-early")
    # What the cancelled encode leaves must be freed by reference counting: a cycle would pin
    # the request's input until some collection.
    with CycleWatch.of_app("epd", ("Ingress", "Encoder"), others=(lookup_registry(req_id=req_id),)) as watch:
        out = encode(cluster, [image_bytes(448, 448, seed=14)], receive_count=1, req_id=req_id, wait=False, expect=202)
        assert out["state"] == "pending"
        cancelled = cluster.http.delete(f"/v1/requests/{req_id}").json()
    assert watch.found == [[]] * len(watch.actors)
    # Whether the cancel beat the encoder or not, the entry ends cancelled and holds nothing.
    assert cancelled["state"] == "cancelled"
    assert ray.get(cluster.ranks[0].fetch.remote(req_id))["error"] == "cancelled"
    after = registry_stats()
    assert after["cancelled_total"] == before["cancelled_total"] + 1
    assert after["staged_total"] - before["staged_total"] <= 1


def test_receiver_for_a_registry_that_does_not_exist_is_unavailable(cluster):
    from registry import EmbeddingReceiver
    from registry.errors import Unavailable

    receiver = EmbeddingReceiver(0, registry_name="no_such_registry")
    with pytest.raises(Unavailable) as info:
        receiver.fetch("anything", timeout_s=1)
    assert info.value.code == "unavailable" and "no_such_registry" in info.value.message


def test_a_rank_s_first_fetch_loads_no_serve(cluster):
    """Ray loads the registry's actor class, for its methods' signatures, in every process
    that calls it: a decoder rank must not pay for Serve and FastAPI on its first fetch."""
    heavy = ["ray.serve", "fastapi", "registry.server.encodes"]
    # A runtime_env of its own: a new worker process, not one that ran other code before.
    fresh = {"env_vars": {"EPD_TEST_FRESH_WORKER": new_id()}}
    rank = RankActor.options(runtime_env=fresh).remote(0)
    try:
        assert ray.get(rank.loaded.remote(heavy)) == []
        out = encode(cluster, [image_bytes(64, 64, seed=12)], receive_count=1)
        got = ray.get(rank.fetch.remote(out["req_id"]))
        assert "error" not in got and got["dtypes"] == ["bfloat16"], got
        assert ray.get(rank.loaded.remote(["registry.server.actor"])) == ["registry.server.actor"]  # Ray did load the class
        assert ray.get(rank.loaded.remote(heavy)) == []
    finally:
        ray.kill(rank)


def test_an_async_rank_s_fetch_never_blocks_its_event_loop(cluster):
    """``fetch_async`` looks the registry up, fetches and reads without one blocking ``ray.get``
    on the actor's loop; Ray would otherwise warn "Using blocking ray.get inside async actor"."""
    fresh = {"env_vars": {"EPD_TEST_FRESH_WORKER": new_id()}}
    rank = RankActor.options(runtime_env=fresh).remote(0)
    try:
        assert ray.get(rank.blocked_its_loop.remote()) is False
        out = encode(cluster, [image_bytes(64, 64, seed=13), image_bytes(320, 320, seed=14)], receive_count=1)
        got = ray.get(rank.fetch.remote(out["req_id"]))
        assert "error" not in got and len(got["shapes"]) == 2, got
        assert ray.get(rank.blocked_its_loop.remote()) is False
    finally:
        ray.kill(rank)
