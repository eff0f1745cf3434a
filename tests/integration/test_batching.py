"""Dynamic batching across callers, and its settings given through user_config."""

import asyncio

import httpx
import ray
from ray import serve

from support import deployment_options, image_bytes, image_item, own_app


def _encode_concurrently(cluster, tag, n, prefix=""):
    """``n`` requests of one item each for one rank, sent at once to the app routed at
    ``prefix``; their req_ids, once every one was answered 200."""
    req_ids = [f"{tag}-{i}" for i in range(n)]

    async def run():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60, headers=cluster.headers) as client:
            bodies = [
                {"req_id": req_id, "receive_count": 1, "items": [image_item(image_bytes(128, 128, seed=i))]}
                for i, req_id in enumerate(req_ids)
            ]
            return await asyncio.gather(*(client.post(f"{prefix}/v1/encode", json=b) for b in bodies))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * n
    return req_ids


def test_batches_form_across_callers_and_user_config_sets_their_size(cluster):
    encoder = serve.get_deployment_handle("Encoder", app_name="epd")
    before = encoder.stats.remote().result()
    req_ids = _encode_concurrently(cluster, "batched", 24)
    results = ray.get([cluster.ranks[0].fetch.remote(req_id, digests=True) for req_id in req_ids])
    assert all("error" not in r for r in results)
    after = encoder.stats.remote().result()
    items, batches = after["items_encoded"] - before["items_encoded"], after["batches"] - before["batches"]
    assert items == 24 and batches < items  # several callers' items shared forward passes
    assert after["max_batch_size"] == 8

    # Another user_config, another batch size: in an app of its own (``own_app``).
    with own_app(cluster.app_args, deployment_options(max_batch_size=1), "unbatched") as app:
        unbatched = serve.get_deployment_handle("Encoder", app_name=app.name)
        assert unbatched.stats.remote().result()["max_batch_size"] == 1
        req_ids = _encode_concurrently(cluster, "unbatched", 8, prefix=app.prefix)
        # No rank of this app's registry: its requests are released by deleting them.
        assert [cluster.http.delete(f"{app.prefix}/v1/requests/{r}").status_code for r in req_ids] == [200] * 8
        stats = unbatched.stats.remote().result()
        assert stats["batches"] == stats["items_encoded"] == 8
