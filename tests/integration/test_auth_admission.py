"""The HTTP API's bearer token, and admission control refusing new work past its limits."""

import hashlib

import httpx
import pytest
import ray
from ray import serve

from registry import get_or_create_registry, media_input
from registry.errors import Overloaded
from support import image_bytes, image_item, registry_settings, registry_stats


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": "Basic x"}])
def test_http_api_needs_the_token_but_health_does_not(cluster, headers):
    for method, path in (("POST", "/v1/encode"), ("GET", "/v1/requests/x"), ("DELETE", "/v1/requests/x"),
                         ("GET", "/v1/stats")):
        response = httpx.request(method, cluster.url + path, headers=headers, json={"items": []}, timeout=30)
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "unauthorized"
        assert response.headers["WWW-Authenticate"] == "Bearer"
    assert httpx.get(cluster.url + "/health", timeout=30).status_code == 200


def test_python_handle_is_not_asked_for_the_token(cluster):
    out = serve.get_app_handle("epd").encode.remote(
        {"receive_count": 1, "items": [image_item(image_bytes(64, 64, seed=111))]}
    ).result()
    assert out["state"] == "staged"
    cluster.http.delete(f"/v1/requests/{out['req_id']}")


def test_staged_bytes_limit_refuses_new_requests_with_overloaded(cluster):
    # One 224x224 embedding (200 KB) fits, two do not.
    settings = registry_settings("admission_registry", cache_max_bytes=0, max_staged_bytes=300 * 1024)
    registry = get_or_create_registry(settings)
    try:
        images = [image_bytes(224, 224, seed=s) for s in (112, 113, 114)]
        digest = [hashlib.sha256(d).hexdigest() for d in images]
        ray.get(registry.submit.remote("adm-1", [media_input(images[0])], digest[0], 1, True))
        ray.get(registry.submit.remote("adm-2", [media_input(images[1])], digest[1], 1, True))  # 200 KB < 300 KB: admitted
        with pytest.raises(Overloaded) as info:
            ray.get(registry.submit.remote("adm-3", [media_input(images[2])], digest[2], 1, True))
        assert info.value.code == "overloaded" and "max_staged_bytes" in info.value.message
        # A retry of an admitted request is still answered.
        assert ray.get(registry.submit.remote("adm-1", [media_input(images[0])], digest[0], 1, True))["state"] == "staged"
        stats = ray.get(registry.stats.remote())
        assert stats["staged"] == 2 and stats["max_staged_bytes"] == 300 * 1024
    finally:
        ray.kill(registry)


def test_object_store_share_caps_staged_bytes(cluster):
    store = ray.cluster_resources()["object_store_memory"]
    # Each shard caps its share; the shares add up to the cap, give or take rounding.
    assert abs(registry_stats()["max_staged_bytes"] - min(8 * 1024**3, int(store * 0.5))) < cluster.app_args["registry_shards"]
