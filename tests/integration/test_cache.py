"""The content-hash cache with the real encoder: repeats run the model once, eviction breaks nothing."""

import hashlib

import httpx
import pytest
import ray
from ray import serve

from registry import EmbeddingReceiver, get_or_create_registry, media_input
from support import MODEL_SPEC, image_bytes, reference_embedding, registry_settings, wait_until

NAMESPACE = "epd-tests"


def _digest(*blobs):
    return hashlib.sha256(b"".join(blobs)).hexdigest()


@pytest.fixture
def cached_registry(request, cluster):
    """A registry with the cache on, sized by the test, calling the shared app's Encoder."""
    settings = registry_settings(f"cache_registry_{request.node.name[:40]}", NAMESPACE, cache_max_bytes=request.param)
    registry = get_or_create_registry(settings)
    yield registry, settings
    ray.kill(registry)  # its cache's objects go with it; no_leaks checks that they do


def _items_encoded():
    return serve.get_deployment_handle("Encoder", app_name="epd").stats.remote().result()["items_encoded"]


def _fetch(settings, req_id, rank=0):
    receiver = EmbeddingReceiver(rank, registry_name=settings.name, registry_namespace=settings.namespace)
    items = receiver.fetch(req_id, timeout_s=30)
    return [item.tensor.view(dtype=__import__("torch").int16).numpy().tobytes() for item in items]


@pytest.mark.parametrize("cached_registry", [64 * 1024 * 1024], indirect=True)
def test_repeated_image_is_encoded_once_and_shared(cluster, cached_registry):
    registry, settings = cached_registry
    image, other = image_bytes(224, 224, seed=61), image_bytes(160, 160, seed=62)
    before = _items_encoded()
    # The same image twice in one request, then again in another request: one model run.
    items = [media_input(image), media_input(image), media_input(other)]
    first = ray.get(registry.submit.remote("c-1", items, _digest(image, image, other), 1, True))
    second = ray.get(registry.submit.remote("c-2", [media_input(image)], _digest(image), 1, True))
    assert _items_encoded() - before == 2
    assert first["items"][0]["mm_hash"] == first["items"][1]["mm_hash"] == second["items"][0]["mm_hash"]
    stats = ray.get(registry.stats.remote())
    # Item 1 joined item 0's encode in flight; the second request hit the cache.
    assert (stats["encodes_joined_total"], stats["cache_hits_total"], stats["cache_items"]) == (1, 1, 2)
    expected = reference_embedding(image, **MODEL_SPEC).tobytes()
    assert _fetch(settings, "c-2") == [expected]
    got = _fetch(settings, "c-1")
    assert got[0] == got[1] == expected

    def scrape():
        text = httpx.get(cluster.metrics_url, timeout=5).text
        hits = [line for line in text.splitlines() if line.startswith("ray_epd_cache_events_total{")
                and 'event="hit"' in line and settings.name in line]
        return hits and float(hits[0].rsplit(" ", 1)[1]) >= 1

    wait_until(scrape, 30, interval_s=1, what="the cache hit metric")


@pytest.mark.parametrize("cached_registry", [300 * 1024], indirect=True)
def test_eviction_never_breaks_an_entry_that_holds_the_item(cluster, cached_registry):
    registry, settings = cached_registry  # room for one 224x224 embedding (200 KB), not two
    a, b = image_bytes(224, 224, seed=63), image_bytes(224, 224, seed=64)
    ray.get(registry.submit.remote("e-a", [media_input(a)], _digest(a), 1, True))
    ray.get(registry.submit.remote("e-b", [media_input(b)], _digest(b), 1, True))  # evicts a's embedding from the cache
    stats = ray.get(registry.stats.remote())
    assert stats["cache_evictions_total"] == 1 and stats["cache_items"] == 1 and stats["cache_bytes"] <= 300 * 1024
    # Entry e-a still holds a's object: the rank gets the right bytes.
    assert _fetch(settings, "e-a") == [reference_embedding(a, **MODEL_SPEC).tobytes()]
    before = _items_encoded()
    ray.get(registry.submit.remote("e-a2", [media_input(a)], _digest(a), 1, True))  # evicted, so encoded again
    assert _items_encoded() - before == 1
    _fetch(settings, "e-b")
    _fetch(settings, "e-a2")
