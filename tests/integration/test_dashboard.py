"""The Grafana dashboard queries only what the service exports (a live /metrics scrape),
and fetch metrics say which transport each fetch came by."""

import hashlib
import json
import pathlib
import re
import uuid

import httpx
import pytest
import ray

from registry import get_or_create_registry, media_input
from support import image_bytes, image_item, registry_settings, wait_until

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "grafana" / "epd-encoder.json"
TRANSPORTS = ("ray", "zmq", "http")


def queries(dashboard: dict) -> list[str]:
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def samples(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]


def test_the_dashboard_is_valid_grafana_json_over_epd_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for expr in queries(dashboard):
        assert re.search(r"\bray_epd_\w+", expr), expr
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("encode requests", "latency", "batch size", "staged bytes", "fetches", "expirations", "errors", "hit rate"):
        assert topic in titles, topic


@pytest.fixture
def cache_traffic(cluster):
    """A cache miss and a hit, in a registry of their own with the cache on (the suite's is off)."""
    image = image_bytes(48, 48, seed=93)
    cached = get_or_create_registry(
        registry_settings(f"dashboard_{uuid.uuid4().hex[:6]}", "epd-tests", cache_max_bytes=16 * 1024 * 1024)
    )
    for req_id in ("dash-a", "dash-b"):
        ray.get(cached.submit.remote(req_id, [media_input(image)], hashlib.sha256(image).hexdigest(), 1, True))
        ray.get(cached.acknowledge.remote(req_id, 0))
    assert ray.get(cached.stats.remote())["cache_hits_total"] == 1
    yield
    ray.kill(cached)  # its cache's objects go with it


@pytest.mark.slow
def test_every_metric_the_dashboard_queries_is_exported(cluster, cache_traffic):
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [f"dash-{transport}-{uuid.uuid4().hex[:8]}" for transport in TRANSPORTS]
    for req_id in ids:
        body = {"req_id": req_id, "receive_count": 1, "items": [image_item(image_bytes(40, 40, seed=94))]}
        assert cluster.http.post("/v1/encode", json=body).status_code == 200
    # One fetch by each transport, and an error.
    assert "error" not in ray.get(cluster.ranks[0].fetch.remote(ids[0]))
    assert cluster.http.post(f"/v1/requests/{ids[1]}/acknowledge", json={"rank": 0, "transport": "zmq"}).json()["released"]
    assert cluster.http.get(f"/v1/requests/{ids[2]}/items", params={"rank": 0}).status_code == 200
    assert cluster.http.post(f"/v1/requests/{ids[2]}/acknowledge", json={"rank": 0}).json()["released"]
    assert cluster.http.get(f"/v1/requests/{ids[2]}/items", params={"rank": 0}).status_code == 410
    names = sorted({name for expr in queries(dashboard) for name in re.findall(r"\bray_epd_\w+", expr)})

    def scrape():
        text = httpx.get(cluster.metrics_url, timeout=5).text
        if not all(samples(text, name) for name in names):
            return None
        by_transport = all(
            any(f'transport="{t}"' in line for line in samples(text, name))
            for t in TRANSPORTS for name in ("ray_epd_fetches_total", "ray_epd_fetch_latency_s_bucket")
        )
        return text if by_transport else None

    text = wait_until(scrape, 60, interval_s=1, what=f"every metric the dashboard queries: {names}")
    # Each label a query groups or filters by is one the metric carries.
    for expr in queries(dashboard):
        labels = {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for label in group.split(",")}
        labels |= set(re.findall(r"[{,]\s*(\w+)\s*=~?\"", expr))
        lines = [line for name in re.findall(r"\bray_epd_\w+", expr) for line in samples(text, name)]
        for label in labels - {"le"}:
            assert any(f'{label}="' in line for line in lines), (label, expr)
