"""200 concurrent HTTP encodes, two TP ranks each: nothing lost, everything released."""

import asyncio

import httpx
import pytest
import ray

from support import image_bytes, image_item, object_store_usage, registry_stats, wait_until

N_REQUESTS = 200


@pytest.mark.slow
def test_200_concurrent_http_encodes_with_2_ranks_each(cluster):
    sizes = [(64, 64), (128, 96), (224, 224), (320, 160), (96, 256)]
    images = [image_bytes(*sizes[i % len(sizes)], seed=100 + i) for i in range(N_REQUESTS)]
    req_ids = [f"load-{i}" for i in range(N_REQUESTS)]
    before = registry_stats()
    plasma_before, _ = object_store_usage()

    # The ranks start waiting first, as a decode engine would, and fetch while encodes land.
    fetches = [rank.fetch.remote(req_id, timeout_s=120, digests=True) for req_id in req_ids for rank in cluster.ranks[:2]]

    async def post_all():
        limits = httpx.Limits(max_connections=N_REQUESTS, max_keepalive_connections=N_REQUESTS)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120, limits=limits, headers=cluster.headers) as client:
            bodies = [{"req_id": r, "receive_count": 2, "items": [image_item(d)]} for r, d in zip(req_ids, images)]
            return await asyncio.gather(*(client.post("/v1/encode", json=b) for b in bodies))

    responses = asyncio.run(post_all())
    assert [r.status_code for r in responses] == [200] * N_REQUESTS, [r.text for r in responses if r.status_code != 200][:3]
    results = ray.get(fetches)
    errors = [r for r in results if "error" in r]
    assert errors == [] and len(results) == 2 * N_REQUESTS
    for i, req_id in enumerate(req_ids):
        rank0, rank1 = results[2 * i], results[2 * i + 1]
        assert rank0["bytes"] == rank1["bytes"]
        w, h = sizes[i % len(sizes)]
        assert rank0["shapes"][0][0] == (h // 16) * (w // 16)

    after = registry_stats()
    assert after["released_total"] - before["released_total"] == N_REQUESTS
    assert after["accepted_total"] - before["accepted_total"] == N_REQUESTS
    del results
    # No replica churned here, so the raw shared-memory figure must come back too.
    wait_until(lambda: object_store_usage()[0] <= plasma_before, 20, what=f"plasma usage back to {plasma_before}")
