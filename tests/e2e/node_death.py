"""The scenario of test_node_death.py, run in its own process: a worker node dies.

A three-node cluster on this machine (``ray.cluster_utils.Cluster``): the head
holds the registry, Serve's controller and proxy, the Ingress and two rank actors;
the Encoder replica runs on worker A, encodes four requests, then is redeployed
to worker B and encodes four more. The head's spare copies are evicted and
worker A is killed. Each rank fetches
every request; what each fetch returned, and how long it took, is printed as one
JSON line, with the registry's and the object store's state afterwards.

Its own process because a process joins one Ray cluster, and the test suite's
other tests share another one.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys
import time

import ray
from ray import serve
from ray.cluster_utils import Cluster

TESTS = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

from benchmarks.cluster import on_pythonpath, serve_http  # noqa: E402
from deployments import compose_app  # noqa: E402
from registry import lookup_registry  # noqa: E402
from support import COLLECT_EVERY_SECOND, DRAIN, RankActor, image_bytes, image_item, object_store_bytes_in_use, reference_embedding, wait_until  # noqa: E402

MODEL = {"family": "tiny-vit", "dtype": "bfloat16"}
REGISTRY = {"registry_name": "node_death_registry", "registry_namespace": "epd-node-death"}
MiB = 1024 * 1024


def _deploy(node_resource: str) -> None:
    args = {**REGISTRY, "cache_max_bytes": 0, "default_receive_count": 2, "model": MODEL}
    options = {  # DRAIN: the A replica that the B one replaces is gone in about a second
        "Encoder": {"ray_actor_options": {"num_cpus": 1, "resources": {node_resource: 1}}, **DRAIN},
        "Ingress": {"ray_actor_options": {"num_cpus": 0, "resources": {"head": 1}}, **DRAIN},
    }
    serve.run(compose_app(args, deployment_options=options), name="epd", route_prefix="/")


def _evict_head_copies() -> None:
    """Fill the head's object store so it evicts the spare copies it holds.

    Serve's router reads each result when its call completes, which leaves a spare
    (unpinned, evictable) copy of every embedding on the caller's node, the head.
    While it lasts, entries survive their node's death; under memory pressure Ray
    drops it, and only the copy on the encoder's node is left. That is the case to
    test: afterwards the only copies of A's entries are on A.
    """
    import numpy as np

    held = [ray.put(np.ones(150 * MiB, dtype=np.uint8)) for _ in range(2)]  # 300 MiB > the head's 200
    del held


def _fetch(rank, req_id: str) -> dict:
    start = time.monotonic()
    out = ray.get(rank.fetch.remote(req_id, timeout_s=30, digests=True))
    return {"error": out.get("error"), "message": out.get("message"), "bytes": out.get("bytes"),
            "seconds": round(time.monotonic() - start, 3)}


def main() -> None:
    # Fast node-failure detection, as a production cluster would tune it.
    detection = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0}
    # _evict_head_copies spills 150 MiB on purpose. Ray refuses any spill while the
    # host's disk is over 95% full, however much room is left; a 1.0 threshold turns
    # that check off for this throwaway cluster, so a nearly full CI disk cannot fail it.
    spill = {"local_fs_capacity_threshold": 1.0}
    on_pythonpath(str(TESTS))  # the workers import the test helpers (RankActor), as the nodes inherit it
    cluster = Cluster(
        initialize_head=True,
        # No dashboard: nothing here reads it, and its port may be another cluster's on this machine.
        head_node_args={"num_cpus": 4, "resources": {"head": 100}, "object_store_memory": 200 * MiB,
                        "include_dashboard": False,
                        "_system_config": {**detection, **spill, **COLLECT_EVERY_SECOND}},  # for the final reading
    )
    try:
        node_a = cluster.add_node(num_cpus=1, resources={"node_a": 1}, object_store_memory=150 * MiB)
        cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=150 * MiB)
        ray.init(address=cluster.address, namespace="epd-node-death")
        serve_http(proxy_location="HeadOnly")
        report = run(cluster, node_a)
        print(json.dumps(report))
    finally:
        # Ending the cluster ends Serve with it; serve.shutdown() would only add its drain wait.
        ray.shutdown()
        cluster.shutdown()


def run(cluster: Cluster, node_a) -> dict:
    registry_name = (REGISTRY["registry_name"], REGISTRY["registry_namespace"])
    ranks = [RankActor.options(resources={"head": 1}).remote(r, *registry_name) for r in range(2)]
    images = {"a": [image_bytes(224, 224, seed=700 + i) for i in range(4)],
              "b": [image_bytes(224, 224, seed=800 + i) for i in range(4)]}
    req_ids: dict[str, list[str]] = {}

    _deploy("node_a")
    baseline = object_store_bytes_in_use()
    handle = serve.get_app_handle("epd")
    for node in ("a", "b"):
        if node == "b":
            _deploy("node_b")  # the A replica is drained and stopped; what it encoded stays on A
        req_ids[node] = [
            handle.encode.remote({"receive_count": 2, "items": [image_item(data)]}).result()["req_id"]
            for data in images[node]
        ]

    _evict_head_copies()
    cluster.remove_node(node_a, allow_graceful=False)
    killed_at = time.monotonic()
    outcomes = {node: [[_fetch(rank, req_id) for rank in ranks] for req_id in ids] for node, ids in req_ids.items()}
    all_answered_s = time.monotonic() - killed_at

    new = handle.encode.remote({"receive_count": 2, "items": [image_item(image_bytes(64, 64, seed=900))]}).result()
    new_outcome = [_fetch(rank, new["req_id"]) for rank in ranks]

    registry = lookup_registry(*registry_name)
    stats = wait_until(lambda: (s := ray.get(registry.stats.remote()))["staged"] == 0 and s, 20, what="an empty registry")
    try:
        wait_until(lambda: object_store_bytes_in_use() <= baseline, 20, interval_s=0.5, what="the object store baseline")
    except AssertionError:
        pass  # reported below, asserted by the test
    return {
        "outcomes": outcomes,
        "expected_b": [[hashlib.sha256(reference_embedding(d, **MODEL).tobytes()).hexdigest()] for d in images["b"]],
        "all_answered_s": round(all_answered_s, 3),
        "new": new_outcome,
        "registry": stats,
        "object_store": {"baseline": baseline, "after": object_store_bytes_in_use()},
        "ranks_blocked_their_loop": ray.get([rank.blocked_its_loop.remote() for rank in ranks]),
    }


if __name__ == "__main__":
    main()
