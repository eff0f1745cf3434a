"""The Encoder autoscales under traffic, up and back down: every request is answered and no
staged entry is lost, because the registry, not the replica, owns what a replica encoded."""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import threading

import httpx
import pytest
import ray
from ray import serve

from deployments import BatchConfig
from support import DRAIN, MODEL_SPEC, image_bytes, image_item, own_app, reference_embedding, wait_until

# Serve's autoscaler, tuned to react within a second or two, on the items each replica holds
# (several may ride in one call): one item per replica is the target, so eight clients ask
# for the second replica at once.
AUTOSCALING = {
    "Encoder": {
        "autoscaling_config": {
            "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
            "metrics_interval_s": 0.2, "look_back_period_s": 0.5, "upscale_delay_s": 0.0, "downscale_delay_s": 1.0,
            "policy": {"policy_function": "deployments.autoscaling:scale_on_items"},
        },
        "ray_actor_options": {"num_gpus": 0.5, "num_cpus": 0},
        # Batches wait for company, so requests pile up on a replica as they would on a busy GPU.
        "user_config": BatchConfig(max_batch_size=4, batch_wait_timeout_s=0.25).model_dump(),
        **DRAIN,
    },
    "Ingress": {"ray_actor_options": {"num_cpus": 0}, **DRAIN},
}


def _encoder_replicas(app) -> dict[str, int]:
    return serve.status().applications[app.name].deployments["Encoder"].replica_states


def _running_encoders(app) -> int:
    return _encoder_replicas(app).get("RUNNING", 0)


class _Traffic:
    """Clients that each encode a new image after another, until told to stop."""

    def __init__(self, cluster, app):
        self._cluster = cluster
        self._app = app
        self._seeds = itertools.count(8000)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.answers: list[tuple[int, int, str | None]] = []  # (seed, status, req_id)

    def run(self, clients: int, until) -> None:
        self._stop.clear()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            workers = [pool.submit(self._client) for _ in range(clients)]
            try:
                wait_until(lambda: until() or any(w.done() for w in workers), 90, interval_s=0.2, what="the replica count")
            finally:
                self._stop.set()
            for worker in workers:
                worker.result()  # a client's own failure shows here

    def _client(self) -> None:
        with httpx.Client(base_url=self._cluster.url, headers=self._cluster.headers, timeout=60) as http:
            while not self._stop.is_set():
                with self._lock:
                    seed = next(self._seeds)
                body = {"receive_count": 1, "items": [image_item(image_bytes(48, 48, seed=seed))]}
                response = http.post(f"{self._app.prefix}/v1/encode", json=body)
                req_id = response.json().get("req_id") if response.status_code == 200 else response.text
                with self._lock:
                    self.answers.append((seed, response.status_code, req_id))


@pytest.mark.slow
def test_the_encoder_scales_up_and_down_under_traffic_and_loses_nothing(cluster):
    with own_app(cluster.app_args, AUTOSCALING, "autoscaling", shards=2, ranks=1) as app:
        traffic = _Traffic(cluster, app)
        try:
            assert _running_encoders(app) == 1
            # The count is read while the clients still run: once they stop, the second replica
            # may already be on its way down (downscale_delay_s is one second).
            traffic.run(8, until=lambda: _running_encoders(app) == 2)  # up, under eight clients
            upscaled_after = len(traffic.answers)
            traffic.run(1, until=lambda: _running_encoders(app) == 1)  # down, while one client goes on
            wait_until(lambda: _encoder_replicas(app) == {"RUNNING": 1}, 60, what="the replica scaled down to stop")
            traffic.run(1, until=lambda: len(traffic.answers) >= upscaled_after + 12)  # and on the one left
            assert _running_encoders(app) == 1
        finally:
            # Every staged entry, whichever replica encoded it and whether it still runs, is
            # fetched whole in one batch; on a failure above too, so nothing stays staged.
            staged = [req_id for _, status, req_id in traffic.answers if status == 200]
            got = ray.get(app.ranks[0].fetch_many.remote(staged, 60.0))

    statuses = [status for _, status, _ in traffic.answers]
    assert statuses == [200] * len(statuses), [a for a in traffic.answers if a[1] != 200]
    for seed, _, req_id in traffic.answers:
        expected = hashlib.sha256(reference_embedding(image_bytes(48, 48, seed=seed), **MODEL_SPEC).tobytes()).hexdigest()
        assert got[req_id] == [expected], (seed, req_id, got[req_id])
