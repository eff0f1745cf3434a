"""Image URLs and local files through the running service: what the policy allows, and what it refuses."""

import asyncio
import os

import httpx
import pytest
import ray
from ray import serve

from support import MODEL_SPEC, data_url, image_bytes, image_item, reference_embedding, registry_stats

SERVED = image_bytes(224, 224, seed=71)  # what conftest's media server and media root hold


def post(cluster, url, receive_count=1):
    body = {"receive_count": receive_count, "items": [{"type": "image_url", "image_url": {"url": url}}]}
    return cluster.http.post("/v1/encode", json=body)


@pytest.mark.parametrize("where", ["http", "file_url", "path"])
def test_allowed_url_or_file_is_encoded(cluster, where):
    url = {
        "http": f"{cluster.media_url}/img.png",
        "file_url": f"file://{cluster.media_root}/local.png",
        "path": os.path.join(cluster.media_root, "local.png"),
    }[where]
    response = post(cluster, url)
    assert response.status_code == 200, response.text
    result = ray.get(cluster.ranks[0].fetch.remote(response.json()["req_id"]))
    assert result["bytes"] == [reference_embedding(SERVED, **MODEL_SPEC).tobytes()]


def test_bad_items_fail_alone_among_concurrent_good_ones(cluster):
    encoder = serve.get_deployment_handle("Encoder", app_name="epd")
    pid = encoder.stats.remote().result()["pid"]
    good = [image_bytes(96, 64, seed=90 + i) for i in range(8)]
    bad = [image_bytes(96, 64, seed=99)[:200] for _ in range(8)]  # truncated PNGs: they fail while decoding

    async def post_all():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60, headers=cluster.headers) as client:
            bodies = [{"req_id": f"mix-{i}", "receive_count": 1, "items": [image_item(d)]} for i, d in enumerate(good + bad)]
            return await asyncio.gather(*(client.post("/v1/encode", json=b) for b in bodies))

    responses = asyncio.run(post_all())
    assert [r.status_code for r in responses] == [200] * 8 + [422] * 8
    results = ray.get([cluster.ranks[0].fetch.remote(f"mix-{i}") for i in range(8)])
    assert [r["bytes"] for r in results] == [[reference_embedding(d, **MODEL_SPEC).tobytes()] for d in good]
    assert encoder.stats.remote().result()["pid"] == pid  # the replica lived through it


def test_video_limits_and_families_without_video(cluster):
    frame = data_url(image_bytes(32, 32, seed=72))
    too_many = cluster.http.post("/v1/encode", json={"items": [{"type": "video", "video": [frame] * 65}]})
    assert too_many.status_code == 422 and "max_video_frames" in too_many.json()["error"]["message"]
    # This app serves tiny-vit, which takes images only: refused by the encoder, alone, as items[0].
    response = cluster.http.post("/v1/encode", json={"receive_count": 1, "items": [{"type": "video", "video": [frame]}]})
    assert response.status_code == 422 and response.json()["error"]["message"].startswith("items[0]: ")
    assert "takes images only" in response.json()["error"]["message"]


def _refusals(cluster, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.png").write_bytes(SERVED)
    link = os.path.join(cluster.media_root, "escape.png")
    if not os.path.lexists(link):
        os.symlink(outside / "secret.png", link)
    port = cluster.media_url.rsplit(":", 1)[1]
    return {
        "redirect (allow_redirects is off)": (f"{cluster.media_url}/redirect/img.png", "set allow_redirects"),
        "host not allowed": ("http://example.com/cat.png", "not in allowed_media_domains"),
        "loopback by IP literal": (f"http://127.0.0.1:{port}/img.png", "not in allowed_media_domains"),
        "cloud metadata": ("http://169.254.169.254/latest/meta-data/", "not in allowed_media_domains"),
        "credentials in URL": (f"http://user:pw@localhost:{port}/img.png", "credentials"),
        "missing remote file": (f"{cluster.media_url}/nope.png", "HTTP 404"),
        "dot-dot escape": (
            f"file://{cluster.media_root}/{os.path.relpath(outside / 'secret.png', cluster.media_root)}",
            "outside allowed_local_media_path",
        ),
        "symlink escape": (link, "outside allowed_local_media_path"),
        "system file": ("file:///etc/passwd", "outside allowed_local_media_path"),
        "other file host": ("file://fileserver/share/cat.png", "no other host"),
    }


def test_refused_urls_and_paths_stage_nothing(cluster, tmp_path_factory):
    before = registry_stats()
    for name, (url, message) in _refusals(cluster, tmp_path_factory).items():
        response = post(cluster, url)
        assert response.status_code == 422, (name, response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_request" and message in error["message"], (name, error)
        assert error["message"].startswith("items[0]: "), (name, error)
    after = registry_stats()
    assert after["accepted_total"] == before["accepted_total"]  # refused before anything was created
