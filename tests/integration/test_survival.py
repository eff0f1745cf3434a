"""Staged embeddings outlive the encoder replica that computed them; entries expire on TTL."""

import asyncio
import hashlib
import os
import signal
import time
import uuid

import pytest
import ray
from ray import serve

from registry import EmbeddingReceiver, get_or_create_registry, media_input
from registry.errors import Expired, Unavailable
from support import MODEL_SPEC, image_bytes, image_item, reference_embedding, registry_settings, wait_until


def _replica_pid(encoder):
    try:
        return encoder.stats.remote().result(timeout_s=5)["pid"]
    except Exception:  # noqa: BLE001 - the replica is still being replaced
        return None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("limits", [{"tombstone_ttl_s": 0}, {"max_tombstones": 0}], ids=["no-tombstone-age", "no-tombstones"])
def test_expiry_goes_on_when_tombstones_are_pruned_at_once(cluster, limits):
    """The expiry timer outlives entries whose tombstones are gone as they end: every entry
    expires on time, also those staged after the first expiry. (More expiries in one tick
    than tombstones kept: ``tests/unit/test_state.py``, where a tick is under the test's control.)"""
    settings = registry_settings(f"expiry_{uuid.uuid4().hex[:8]}", ttl_s=1.0, cache_max_bytes=0, **limits)
    registry = get_or_create_registry(settings)
    try:
        for round_ in range(2):  # the second round expires only if the timer survived the first
            req_ids = [f"exp-{round_}-{i}" for i in range(4)]
            ray.get([
                registry.submit.remote(r, [media_input(image_bytes(64, 64, seed=40 + 4 * round_ + i))], r, 2, True)
                for i, r in enumerate(req_ids)
            ])
            rank0 = EmbeddingReceiver(0, registry_name=settings.name, registry_namespace=settings.namespace)
            for req_id in req_ids:
                rank0.fetch(req_id)
            wait_until(lambda: ray.get(registry.stats.remote())["staged"] == 0, 10, what=f"round {round_} to expire")
            assert ray.get(registry.stats.remote())["expired_total"] == 4 * (round_ + 1)
    finally:
        ray.kill(registry)


@pytest.mark.slow
def test_kill_encoder_replica_after_staging_every_rank_still_fetches(cluster):
    encoder = serve.get_deployment_handle("Encoder", app_name="epd")
    pid = _replica_pid(encoder)
    images = [image_bytes(224, 224, seed=21), image_bytes(320, 240, seed=22)]
    body = {"req_id": "survive-1", "receive_count": 3, "items": [image_item(d) for d in images]}
    assert cluster.http.post("/v1/encode", json=body).json()["state"] == "staged"

    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not _alive(pid), 10, what="the replica process to die")

    results = ray.get([rank.fetch.remote("survive-1", digests=True) for rank in cluster.ranks[:3]])
    expected = [hashlib.sha256(reference_embedding(d, **MODEL_SPEC).tobytes()).hexdigest() for d in images]
    for result in results:
        assert "error" not in result, result
        assert result["bytes"] == expected

    # Serve replaces the replica, and the service encodes again.
    new_pid = wait_until(lambda: (p := _replica_pid(encoder)) not in (None, pid) and p, 60, what="a new replica")
    assert new_pid != pid
    body = {"req_id": "survive-2", "receive_count": 1, "items": [image_item(images[0])]}
    assert cluster.http.post("/v1/encode", json=body).json()["state"] == "staged"
    assert ray.get(cluster.ranks[0].fetch.remote("survive-2", digests=True))["bytes"] == expected[:1]


def test_entry_not_fully_received_within_ttl_expires_and_frees_memory(cluster):
    settings = registry_settings("ttl_test_registry", ttl_s=1.0)
    registry = get_or_create_registry(settings)
    try:
        data = image_bytes(224, 224, seed=23)
        out = ray.get(registry.submit.remote("ttl-1", [media_input(data)], "digest-ttl-1", 2, True))
        assert out["state"] == "staged"
        rank0 = EmbeddingReceiver(0, registry_name=settings.name, registry_namespace=settings.namespace)
        rank1 = EmbeddingReceiver(1, registry_name=settings.name, registry_namespace=settings.namespace)
        assert rank0.fetch("ttl-1")[0].meta["shape"] == [196, 512]
        start = time.monotonic()
        wait_until(lambda: ray.get(registry.stats.remote())["expired_total"] == 1, 10, what="the entry to expire")
        assert time.monotonic() - start < 3.0
        with pytest.raises(Expired) as info:
            rank1.fetch("ttl-1", timeout_s=1)
        assert info.value.details["received_ranks"] == [0]
        stats = ray.get(registry.stats.remote())
        assert (stats["staged"], stats["live_refs"], stats["staged_bytes"]) == (0, 0, 0)
        described = ray.get(registry.describe.remote("ttl-1"))
        assert described["state"] == "expired"
    finally:
        ray.kill(registry)


@pytest.mark.slow
def test_registry_crash_restarts_and_lost_entries_fail_fast(cluster):
    settings = registry_settings("crash_test_registry", cache_max_bytes=0)
    registry = get_or_create_registry(settings)
    receiver = EmbeddingReceiver(0, registry_name=settings.name, registry_namespace=settings.namespace)
    try:
        data = image_bytes(224, 224, seed=24)
        assert ray.get(registry.submit.remote("crash-1", [media_input(data)], "d1", 2, True))["state"] == "staged"
        pid = ray.get(registry.ping.remote())["pid"]
        ray.kill(registry, no_restart=False)  # a crash: Ray restarts it (max_restarts=-1), empty
        restarted = wait_until(lambda: _ping_pid(registry) not in (None, pid), 30, what="the registry to restart")
        assert restarted != pid

        # The entry died with the old process: told at once (after the short grace), not at the timeout.
        start = time.monotonic()
        with pytest.raises(Unavailable) as info:
            receiver.fetch("crash-1", timeout_s=30)
        assert time.monotonic() - start < 15 and "restarted" in info.value.message

        # New requests work, including a rank that asks before the encode arrives.
        async def early_fetch_then_encode():
            fetch = asyncio.ensure_future(receiver.fetch_async("crash-2", timeout_s=30))
            while (await registry.stats.remote())["waiting_calls"] < 1:  # the rank is waiting now
                await asyncio.sleep(0.05)
            await registry.submit.remote("crash-2", [media_input(data)], "d2", 1, True)
            return await fetch

        items = asyncio.run(early_fetch_then_encode())
        assert items[0].meta["shape"] == [196, 512]
        del items
    finally:
        ray.kill(registry)


def _dead(actor) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=5)
    except ray.exceptions.RayActorError:
        return True
    except ray.exceptions.GetTimeoutError:
        pass
    return False


def _ping_pid(registry):
    try:
        return ray.get(registry.ping.remote(), timeout=5)["pid"]
    except Exception:  # noqa: BLE001 - restarting
        return None


@pytest.mark.slow
def test_registry_killed_for_good_is_reported_503_and_recreated(cluster):
    from registry import lookup_registry

    staged = cluster.http.post(
        "/v1/encode", json={"receive_count": 1, "items": [image_item(image_bytes(224, 224, seed=25))]}
    ).json()
    shard = lookup_registry(req_id=staged["req_id"])  # the registry (shard) holding it
    ray.kill(shard, no_restart=True)
    wait_until(lambda: _dead(shard), 30, what="the killed shard to be dead (ray.kill returns before it is)")
    health = cluster.http.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    # That failed call brought up a new registry; the service answers again within seconds.
    wait_until(lambda: cluster.http.get("/health").status_code == 200, 30, what="a healthy service again")
    out = cluster.http.post("/v1/encode", json={"receive_count": 1, "items": [image_item(image_bytes(64, 64, seed=26))]})
    assert out.status_code == 200
    # Ranks find the new registry by name (their cached handle points at the dead one).
    assert "error" not in ray.get(cluster.ranks[0].fetch.remote(out.json()["req_id"], timeout_s=10))
    lost = ray.get(cluster.ranks[0].fetch.remote(staged["req_id"], timeout_s=30))
    assert lost["error"] == "unavailable" and "encode it again" in lost["message"]
