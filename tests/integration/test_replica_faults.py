"""Faults around encoding: a client that goes away before its encode is staged, a
replica killed with items in its batch, a false report of lost objects."""

import asyncio
import concurrent.futures
import hashlib
import os
import signal
import time

import httpx
import pytest
import ray
from ray import serve

from deployments import BatchConfig
from support import DRAIN, MODEL_SPEC, image_bytes, image_item, own_app, reference_embedding, wait_until

# Two replicas that hold every item for five seconds before a forward pass, so a
# kill or a client's departure lands while items sit in a batch.
TWO_SLOW_REPLICAS = {
    "Encoder": {
        "num_replicas": 2,
        "ray_actor_options": {"num_gpus": 0.5, "num_cpus": 0},
        "user_config": BatchConfig(max_batch_size=64, batch_wait_timeout_s=5.0).model_dump(),
        **DRAIN,
    },
    "Ingress": {"ray_actor_options": {"num_cpus": 0}, **DRAIN},
}


def _replicas(encoder, want: int) -> dict[int, dict]:
    """pid -> stats of each Encoder replica, by asking until ``want`` distinct ones answered
    (the handle routes each call to one of them)."""
    seen: dict[int, dict] = {}
    deadline = time.monotonic() + 30
    while len(seen) < want:
        assert time.monotonic() < deadline, f"only replicas {sorted(seen)} answered"
        stats = encoder.stats.remote().result(timeout_s=10)
        seen[stats["pid"]] = stats
    return seen


@pytest.fixture(scope="module")
def slow(cluster):
    """An app of its own with TWO_SLOW_REPLICAS, a registry of two shards and one rank, for
    this module's tests that need them; yields it and its Encoder's handle."""
    with own_app(cluster.app_args, TWO_SLOW_REPLICAS, "slow", shards=2, ranks=1) as app:
        encoder = serve.get_deployment_handle("Encoder", app_name=app.name)
        _replicas(encoder, 2)
        yield app, encoder


def _wait_cancelled(cluster, app, req_id):
    seen = []
    try:
        wait_until(lambda: seen.append(cluster.http.get(f"{app.prefix}/v1/requests/{req_id}").json()) or
                   seen[-1].get("state") == "cancelled", 4, what=f"{req_id} to be cancelled")
    except AssertionError:
        raise AssertionError(f"{req_id} was not cancelled within 4 s; last seen: {seen[-1]}") from None


def test_client_gone_before_staging_cancels_the_request_and_nothing_is_staged(cluster, slow):
    app, _ = slow
    body = {"req_id": "gone-http", "receive_count": 1, "items": [image_item(image_bytes(128, 128, seed=320))]}
    waiting_rank = app.ranks[0].fetch.remote("gone-http", timeout_s=30)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the item waits for its batch
        httpx.post(f"{cluster.url}{app.prefix}/v1/encode", json=body, headers=cluster.headers, timeout=1.0)
    gone_at = time.monotonic()
    _wait_cancelled(cluster, app, "gone-http")
    assert ray.get(waiting_rank)["error"] == "cancelled"  # its rank is told, not left waiting
    assert time.monotonic() - gone_at < 5

    # The same through the Python handle: a caller that cancels its call, while another
    # request for the same image shares that item's encode and must not lose it.
    handle = serve.get_app_handle(app.name)
    response = handle.encode.remote({**body, "req_id": "gone-handle"})
    wait_until(lambda: app.stats()["pending"] == 1, 10, what="the request to reach the registry")
    stays = handle.encode.remote({**body, "req_id": "stays"})
    wait_until(lambda: app.stats()["pending"] == 2, 10, what="the second request to reach the registry")
    response.cancel()
    _wait_cancelled(cluster, app, "gone-handle")
    assert stays.result(timeout_s=30)["state"] == "staged"
    assert "error" not in ray.get(app.ranks[0].fetch.remote("stays"))

    # The items' encodes were stopped, not staged: once nothing is encoding, nothing is there.
    wait_until(lambda: (s := app.stats())["encodes_in_flight"] == 0 and s["item_encodes_in_flight"] == 0, 20,
               what="no encode in flight")
    stats = app.stats()
    assert (stats["staged"], stats["pending"]) == (0, 0)
    assert cluster.http.get(f"{app.prefix}/v1/requests/gone-http").json()["state"] == "cancelled"


def test_replica_killed_mid_batch_its_items_are_encoded_on_another_replica(cluster, slow):
    app, encoder = slow
    images = [image_bytes(128, 128, seed=300 + i) for i in range(8)]
    bodies = [{"req_id": f"midbatch-{i}", "receive_count": 1, "items": [image_item(d)]} for i, d in enumerate(images)]
    retries_before = app.stats()["replica_retries_total"]

    async def encode_all():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60, headers=cluster.headers) as client:
            return await asyncio.gather(*(client.post(f"{app.prefix}/v1/encode", json=b) for b in bodies))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(asyncio.run, encode_all())
        # Every item is inside a replica, waiting for its batch; kill a replica that has some.
        busy = wait_until(
            lambda: [pid for pid, s in _replicas(encoder, 2).items() if s["items_in_progress"] > 0],
            20, what="items to reach the replicas",
        )
        wait_until(lambda: app.stats()["item_encodes_in_flight"] == len(bodies), 10, what="all items in flight")
        os.kill(busy[0], signal.SIGKILL)
        killed_at = time.monotonic()
        responses = pending.result(timeout=120)
    answered_in = time.monotonic() - killed_at
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.json() for r in responses]
    assert all(r.json()["state"] == "staged" for r in responses)
    assert answered_in < 25  # the retry waits one batch window on the other replica, not a timeout
    assert app.stats()["replica_retries_total"] > retries_before
    results = ray.get([app.ranks[0].fetch.remote(b["req_id"], digests=True) for b in bodies])
    expected = [[hashlib.sha256(reference_embedding(d, **MODEL_SPEC).tobytes()).hexdigest()] for d in images]
    assert [r.get("bytes", r) for r in results] == expected


def test_a_false_report_of_lost_objects_does_not_end_the_entry(cluster):
    from registry import lookup_registry

    out = cluster.http.post("/v1/encode", json={"receive_count": 1, "items": [image_item(image_bytes(224, 224, seed=310))]})
    req_id = out.json()["req_id"]
    # The registry reads the objects itself before believing a rank: they are fine here.
    assert ray.get(lookup_registry(req_id=req_id).report_lost.remote(req_id)) is False
    assert ray.get(lookup_registry(req_id="never-encoded").report_lost.remote("never-encoded")) is False
    assert "error" not in ray.get(cluster.ranks[0].fetch.remote(req_id))
