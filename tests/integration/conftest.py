"""One real local Ray cluster (fake GPUs) with the epd app deployed, shared by the session.

Every test runs under ``no_leaks``: afterwards the registry holds nothing and the
object store is back to where it was before the test.
"""

from __future__ import annotations

import dataclasses
import gc
import pathlib
import secrets

import httpx
import pytest
import ray
from ray import serve

from benchmarks.cluster import free_port, on_pythonpath, serve_http
from deployments import compose_app
from registry.states import LIVE_STATES, MAX_LIST_LIMIT
from support import (
    APP_ARGS, COLLECT_EVERY_SECOND, RankActor, deployment_options, holds_nothing, image_bytes, media_server, registry_stats, stored_objects,
    wait_until,
)


@dataclasses.dataclass
class Cluster:
    url: str
    http: httpx.Client
    ranks: list
    metrics_url: str
    app_args: dict  # what the "epd" app was deployed with
    media_url: str  # a local HTTP server the app may fetch from
    media_root: str  # the app's allowed_local_media_path
    headers: dict  # what an HTTP client of the app must send (its bearer token)


MEDIA_FILES = {"/img.png": image_bytes(224, 224, seed=71)}
REGISTRY_SHARDS = 4
API_TOKEN = "test-token-" + secrets.token_hex(16)
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    # Workers import the test helpers (RankActor) from tests/: on PYTHONPATH before the cluster
    # starts, which every Ray process inherits. A job runtime_env would start each of the
    # suite's ~90 workers through Ray's runtime-env agent, at 0.4 CPU-s more each.
    on_pythonpath(str(pathlib.Path(__file__).resolve().parents[1]))
    metrics_port = free_port()
    ray.init(
        num_cpus=8,
        num_gpus=2,
        namespace="epd-tests",
        include_dashboard=False,
        _metrics_export_port=metrics_port,  # Prometheus endpoint, as the dashboard reads it
        _system_config={"metrics_report_interval_ms": 1000, **COLLECT_EVERY_SECOND},  # for no_leaks
    )
    url = serve_http()
    media_root = tmp_path_factory.mktemp("media")
    (media_root / "local.png").write_bytes(MEDIA_FILES["/img.png"])
    with media_server(MEDIA_FILES) as media_url:
        app_args = {
            **APP_ARGS,
            # Remote and local media on, narrowly: this machine's test server and one folder.
            "allowed_media_domains": ["localhost"],
            "allowed_private_networks": ["127.0.0.1/32", "::1/128"],
            "allowed_local_media_path": str(media_root),
            "api_token": API_TOKEN,  # every HTTP call of the suite carries it (Cluster.headers)
            # Every semantic test runs against a sharded registry; the apps tests deploy
            # for themselves have as many as they need (support.own_app).
            "registry_shards": REGISTRY_SHARDS,
        }
        serve.run(compose_app(app_args, deployment_options=deployment_options()), name="epd", route_prefix="/")
        ranks = [RankActor.remote(r) for r in range(4)]
        with httpx.Client(base_url=url, timeout=60, headers=AUTH) as http:
            wait_until(lambda: http.get("/health").status_code == 200, 60, what="/health to answer 200")
            yield Cluster(
                url=url, http=http, ranks=ranks, metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
                app_args=app_args, media_url=media_url, media_root=str(media_root), headers=AUTH,
            )
    # The cluster is this session's own (ray.init started it), so ending it ends every
    # process in it, the detached registry shards included. serve.shutdown() first would
    # add nothing but its wait for a graceful drain: about a minute here.
    ray.shutdown()


@pytest.fixture(autouse=True)
def no_leaks(cluster):
    # A full collection of this process (torch, transformers and vLLM imported) takes
    # 0.3-0.5 s. Freezing what exists before the test lets the collection after it scan
    # only what the test created, which is where a leaked reference cycle would be.
    gc.freeze()
    before = stored_objects().keys()
    yield
    gc.collect()
    try:
        wait_until(lambda: holds_nothing(registry_stats()), 20, what="the registry to be empty")
    except AssertionError:
        stats = registry_stats()
        held = {key: stats[key] for key in ("pending", "staged", "live_refs")}
        raise AssertionError(f"the registry is not empty: {held}; its live (req_id, state), now cancelled: {_cancel_live_entries(cluster)}") from None
    # A leak is an object the test made that something still references. Most tests leave
    # none, and are passed without a cluster-wide garbage collection (a round costs every
    # worker a collection); one whose replica died may leave refs in Serve's router in
    # reference cycles, which only a collection frees.
    def left(collect: bool) -> dict:
        return {oid: held for oid, held in stored_objects(collect).items() if oid not in before}

    if left(collect=False):
        try:
            wait_until(lambda: not left(collect=True), 20, interval_s=0.5, what="the objects the test made to be freed")
        except AssertionError:
            held = [(oid.hex(), size, holders) for oid, (size, holders) in left(collect=True).items()]
            if held:  # freed between the last poll and this reading: not a leak
                raise AssertionError(f"objects still referenced (id, bytes, holders): {held}") from None


def _cancel_live_entries(cluster: Cluster) -> list[tuple[str, str]]:
    """Cancel the pending and staged entries of the suite's app, through its API; answers
    ``(req_id, state)`` of each. A test that fails halfway leaves what it staged: cancelling
    it keeps that one failure from failing every later test's leak check too. One page of
    each state (up to MAX_LIST_LIMIT) is far more than one test leaves."""
    left = [(entry["req_id"], entry["state"]) for state in LIVE_STATES for entry in
            cluster.http.get("/v1/requests", params={"state": state, "limit": MAX_LIST_LIMIT}).json()["requests"]]
    for req_id, _ in left:
        cluster.http.delete(f"/v1/requests/{req_id}")
    return left
