"""The epd_ metrics reach Ray's Prometheus endpoint (what the Ray dashboard charts)."""

import httpx
import pytest
import ray

from support import image_bytes, image_item, wait_until

EXPECTED = [
    "ray_epd_encode_requests_total",
    "ray_epd_encode_latency_s_bucket",
    "ray_epd_encoder_batch_size_bucket",
    "ray_epd_encoder_forward_s_bucket",
    "ray_epd_encoder_items_total",
    "ray_epd_pending_entries",
    "ray_epd_staged_entries",
    "ray_epd_staged_bytes",
    "ray_epd_fetches_total",
    "ray_epd_entries_ended_total",
    "ray_epd_errors_total",
]


def _sample(text, name, **labels):
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.slow
def test_metrics_are_exported_and_move(cluster):
    out = cluster.http.post(
        "/v1/encode", json={"req_id": "metrics-1", "receive_count": 1, "items": [image_item(image_bytes(64, 64, seed=41))]}
    ).json()
    assert "error" not in ray.get(cluster.ranks[0].fetch.remote(out["req_id"]))
    assert ray.get(cluster.ranks[0].fetch.remote(out["req_id"]))["error"] == "already_released"

    def scrape():
        text = httpx.get(cluster.metrics_url, timeout=5).text
        ready = all(name in text for name in EXPECTED) and _sample(text, "ray_epd_errors_total", code="already_released") >= 1
        return text if ready else None

    text = wait_until(scrape, 30, interval_s=1, what="the epd_ metrics on the Prometheus endpoint")
    assert _sample(text, "ray_epd_entries_ended_total", state="released") >= 1
    assert _sample(text, "ray_epd_fetches_total", result="released") >= 1
    assert _sample(text, "ray_epd_encode_requests_total", result="accepted") >= 1
    assert _sample(text, "ray_epd_encoder_items_total") >= 1
