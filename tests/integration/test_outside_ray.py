"""Decoder ranks outside Ray: ZMQ receivers in plain processes, alone and mixed with Ray and
HTTP ranks in one request, under the same release rules (the HTTP pull's own rules:
``test_http_pull.py``)."""

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import uuid

import pytest
import ray
import safetensors
import safetensors.torch
import torch

from registry.errors import Unauthorized
from registry.client.zmq_receiver import ZmqEmbeddingReceiver
from support import MODEL_SPEC, deployment_options, image_bytes, image_item, own_app, reference_embedding, wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
# One item under the inline limit (it rides in the registry's reply), one over it (read from the store).
IMAGES = [image_bytes(224, 160, seed=81), image_bytes(64, 64, seed=82)]
EXPECTED = [hashlib.sha256(reference_embedding(d, **MODEL_SPEC).tobytes()).hexdigest() for d in IMAGES]


class ZmqRank:
    """``tests/zmq_rank.py`` in its own process: a rank that never imports Ray."""

    def __init__(self, url: str, rank: int, token: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["PYTHONPATH"] = str(ROOT)
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "zmq_rank.py"), url, str(rank), token],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.endpoint = self._read()["endpoint"]

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        assert line, f"the rank process exited with {self.process.wait(5)}"
        return json.loads(line)

    def __call__(self, op: str, req_id: str | None = None, **args) -> dict:
        self.process.stdin.write(json.dumps({"op": op, "req_id": req_id, **args}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(10)


@pytest.fixture(scope="module")
def zmq_ranks(cluster):
    ranks = [ZmqRank(cluster.url, r, cluster.app_args["api_token"]) for r in range(2)]
    yield ranks
    for rank in ranks:
        rank.close()


def encode(cluster, receive_count, prefix="out"):
    req_id = f"{prefix}-{uuid.uuid4().hex[:12]}"
    body = {"req_id": req_id, "receive_count": receive_count, "items": [image_item(d) for d in IMAGES]}
    response = cluster.http.post("/v1/encode", json=body)
    assert response.status_code == 200, response.text
    return req_id


def state(cluster, req_id):
    out = cluster.http.get(f"/v1/requests/{req_id}").json()
    return out["state"], out["received_ranks"]


def pull(cluster, req_id, rank, **params):
    return cluster.http.get(f"/v1/requests/{req_id}/items", params={"rank": rank, **params})


def pulled_digests(body: bytes) -> list[str]:
    tensors = safetensors.torch.load(body)
    assert sorted(tensors) == [f"item_{i}" for i in range(len(tensors))]
    return [hashlib.sha256(tensors[f"item_{i}"].view(torch.int16).numpy().tobytes()).hexdigest() for i in range(len(tensors))]


def test_zmq_ranks_in_plain_processes_get_the_bytes_a_ray_rank_gets(cluster, zmq_ranks):
    req_id = encode(cluster, receive_count=2)
    ray_rank = ray.get(cluster.ranks[0].fetch.remote(req_id, digests=True))
    assert ray_rank["bytes"] == EXPECTED
    # Rank 0 again, over ZMQ: the same bits, and it does not count twice.
    first = zmq_ranks[0]("fetch", req_id)
    assert first["digests"] == EXPECTED and first["dtypes"] == ["bfloat16", "bfloat16"]
    assert first["shapes"] == ray_rank["shapes"] and first["metas"] == ray_rank["metas"]
    assert state(cluster, req_id) == ("staged", [0])
    second = zmq_ranks[1]("fetch", req_id)
    assert second["digests"] == EXPECTED
    assert state(cluster, req_id) == ("released", [0, 1])
    late = zmq_ranks[0]("fetch", req_id)
    assert late["error"] == "already_released" and late["details"]["received_ranks"] == [0, 1]
    assert zmq_ranks[0]("modules") == {"ray": False}


def test_repeated_registrations_and_acknowledgements_count_once(cluster, zmq_ranks):
    req_id = encode(cluster, receive_count=2)
    # Pushed twice, received twice, never acknowledged: not counted.
    assert zmq_ranks[0]("register", req_id) == {"received": 2}
    assert zmq_ranks[0]("register", req_id) == {"received": 2}
    assert state(cluster, req_id) == ("staged", [])
    assert zmq_ranks[0]("fetch", req_id)["digests"] == EXPECTED
    assert zmq_ranks[0]("acknowledge", req_id) == {"released": False}
    assert zmq_ranks[0]("acknowledge", req_id) == {"released": False}
    assert state(cluster, req_id) == ("staged", [0])
    assert zmq_ranks[1]("acknowledge", req_id) == {"released": True}
    assert state(cluster, req_id) == ("released", [0, 1])


def test_zmq_ranks_get_the_registry_errors_with_their_codes(cluster, zmq_ranks):
    req_id = f"out-{uuid.uuid4().hex[:12]}"
    body = {"req_id": req_id, "receive_count": 1, "items": [image_item(IMAGES[1])]}
    assert cluster.http.post("/v1/encode", json=body).status_code == 200
    out_of_range = zmq_ranks[1]("fetch", req_id)
    assert out_of_range["error"] == "invalid_rank" and "ranks are 0..0" in out_of_range["message"]
    assert cluster.http.delete(f"/v1/requests/{req_id}").json()["state"] == "cancelled"
    assert zmq_ranks[0]("fetch", req_id)["error"] == "cancelled"
    assert zmq_ranks[0]("fetch", f"never-{uuid.uuid4().hex[:8]}", timeout_s=0)["error"] == "not_ready"
    # The service's token is honoured: a receiver with a wrong one is refused before anything is read.
    with ZmqEmbeddingReceiver(rank=0, url=cluster.url, api_token="wrong-token-0123456789") as rx:
        with pytest.raises(Unauthorized):
            rx.fetch(req_id, timeout_s=0)


def test_one_request_mixes_ray_zmq_and_http_ranks(cluster, zmq_ranks):
    req_id = encode(cluster, receive_count=3)
    assert ray.get(cluster.ranks[0].fetch.remote(req_id, digests=True))["bytes"] == EXPECTED
    assert state(cluster, req_id) == ("staged", [0])
    assert zmq_ranks[1]("fetch", req_id)["digests"] == EXPECTED
    assert state(cluster, req_id) == ("staged", [0, 1])
    response = pull(cluster, req_id, 2)
    assert response.status_code == 200, response.text
    assert pulled_digests(response.content) == EXPECTED
    assert state(cluster, req_id) == ("staged", [0, 1])  # pulled: counted at its acknowledgement
    assert cluster.http.post(f"/v1/requests/{req_id}/acknowledge", json={"rank": 2}).json()["released"]
    assert state(cluster, req_id) == ("released", [0, 1, 2])


@pytest.mark.parametrize("endpoint", ["tcp://10.1.2.3:5555", "tcp://localhost:5555", "ipc:///tmp/x", "tcp://127.0.0.1:0"])
def test_a_push_endpoint_outside_the_policy_is_refused_and_nothing_counts(cluster, endpoint):
    req_id = encode(cluster, receive_count=1)
    response = cluster.http.post(f"/v1/requests/{req_id}/push", json={"rank": 0, "endpoint": endpoint})
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request", response.text
    assert state(cluster, req_id) == ("staged", [])
    assert cluster.http.delete(f"/v1/requests/{req_id}").json()["state"] == "cancelled"


@pytest.fixture
def short_ttl_app(cluster):
    with own_app({**cluster.app_args, "ttl_s": 2.0}, deployment_options(), "ttl") as app:
        yield app.prefix


@pytest.mark.slow
def test_a_rank_that_registers_and_never_acknowledges_lets_the_entry_expire(cluster, short_ttl_app):
    rank = ZmqRank(cluster.url + short_ttl_app, 0, cluster.app_args["api_token"])
    try:
        req_id = f"ttl-{uuid.uuid4().hex[:8]}"
        body = {"req_id": req_id, "receive_count": 1, "items": [image_item(IMAGES[0])]}
        assert cluster.http.post(f"{short_ttl_app}/v1/encode", json=body).status_code == 200
        assert rank("register", req_id) == {"received": 1}
        described = cluster.http.get(f"{short_ttl_app}/v1/requests/{req_id}").json()
        assert described["state"] == "staged" and described["received_ranks"] == []
        # Registered and received, never acknowledged: the ttl ends it as if the rank never came.
        final = wait_until(
            lambda: (d := cluster.http.get(f"{short_ttl_app}/v1/requests/{req_id}").json())["state"] != "staged" and d,
            10, what="the entry to expire",
        )
        assert final["state"] == "expired" and final["received_ranks"] == []
        assert 2.0 <= final["ended_at"] - final["staged_at"] < 2.0 + 1.0
        assert rank("fetch", req_id)["error"] == "expired"
    finally:
        rank.close()
