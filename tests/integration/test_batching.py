"""Dynamic batching across callers, and its settings changed live through user_config."""

import asyncio

import httpx
import ray
from ray import serve

from deployments import compose_app
from support import deployment_options, image_bytes, image_item, wait_until


def _encode_concurrently(cluster, tag, n):
    async def run():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60, headers=cluster.headers) as client:
            bodies = [
                {"req_id": f"{tag}-{i}", "receive_count": 1, "items": [image_item(image_bytes(128, 128, seed=i))]}
                for i in range(n)
            ]
            return await asyncio.gather(*(client.post("/v1/encode", json=b) for b in bodies))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * n
    results = ray.get([cluster.ranks[0].fetch.remote(f"{tag}-{i}", digests=True) for i in range(n)])
    assert all("error" not in r for r in results)


def test_batches_form_across_callers_and_user_config_changes_them_live(cluster):
    encoder = serve.get_deployment_handle("Encoder", app_name="epd")
    before = encoder.stats.remote().result()
    _encode_concurrently(cluster, "batched", 24)
    after = encoder.stats.remote().result()
    items, batches = after["items_encoded"] - before["items_encoded"], after["batches"] - before["batches"]
    assert items == 24 and batches < items  # several callers' items shared forward passes

    # A user_config change applies to the next batches. (serve.run from Python restarts
    # the replica to apply it; `serve deploy` of a changed config file reconfigures it live.)
    try:
        serve.run(
            compose_app(cluster.app_args, deployment_options=deployment_options(max_batch_size=1)), name="epd", route_prefix="/"
        )
        wait_until(lambda: encoder.stats.remote().result()["max_batch_size"] == 1, 30, what="the new batch size")
        before = encoder.stats.remote().result()
        _encode_concurrently(cluster, "unbatched", 8)
        after_one = encoder.stats.remote().result()
        assert after_one["batches"] - before["batches"] == after_one["items_encoded"] - before["items_encoded"] == 8
    finally:
        serve.run(compose_app(cluster.app_args, deployment_options=deployment_options()), name="epd", route_prefix="/")
    assert encoder.stats.remote().result()["max_batch_size"] == 8
