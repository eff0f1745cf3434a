"""``serve run serve_config.yaml`` as a user runs it (the session's ``service``): a plain HTTP request,
the decoder example, a redeploy."""

import itertools
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml

from serve_run import URL, gcs_address
from support import image_bytes, image_item, wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = "http://127.0.0.1:8265"  # the dashboard of the cluster `serve run` starts


def _curl(*args: str) -> dict:
    done = subprocess.run(["curl", "-s", "--max-time", "60", *args], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_curl_encode_on_the_default_config(service, tmp_path):
    # As the README shows it: the JSON body in a file (an image is too long for one argument).
    body = tmp_path / "req.json"
    body.write_text(json.dumps({"receive_count": 1, "items": [image_item(image_bytes(224, 224, seed=1))]}))
    out = _curl(f"{URL}/v1/encode", "-H", "content-type: application/json", "--data-binary", f"@{body}")
    assert out["state"] == "staged" and out["items"][0]["shape"] == [64, 256] and out["items"][0]["dtype"] == "float32"
    assert _curl("-X", "DELETE", f"{URL}/v1/requests/{out['req_id']}")["state"] == "cancelled"
    stats = _curl(f"{URL}/v1/stats")
    assert stats["staged"] == 0 and stats["pending"] == 0


def _ray_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Ray 2.60 clusters require a token; a driver given an explicit address sends it only
    # when told to (with address="auto" it finds out from the local session).
    env["RAY_AUTH_MODE"] = "token"
    return env


def _decoder(service, *args: str) -> dict:
    """Run examples/decoder_tp2.py against the service's cluster; its JSON output."""
    address = gcs_address(service)
    done = subprocess.run(
        [sys.executable, "examples/decoder_tp2.py", "--url", URL, "--address", address, *args], cwd=ROOT,
        env=_ray_env(), capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_decoder_example_fetches_on_two_ranks(service):
    start = time.monotonic()
    result = _decoder(service)
    ranks = {r["rank"]: r["items"] for r in result["ranks"]}
    assert sorted(ranks) == [0, 1]
    assert ranks[0] == ranks[1] and ranks[0][0]["shape"] == [88, 256]
    assert ranks[0][0]["shape"] == result["encoded"][0]["shape"]
    state = httpx.get(f"{URL}/v1/requests/{result['req_id']}", timeout=30).json()
    assert state["state"] == "released" and state["received_ranks"] == [0, 1]
    assert time.monotonic() - start < 180


@pytest.mark.parametrize("example", ["decoder_zmq.py", "decoder_http.py"])
def test_decoder_examples_outside_ray_fetch_on_two_ranks(service, example):
    # Plain processes: no Ray address, no token for the cluster; the service's URL only.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run(
        [sys.executable, f"examples/{example}", "--url", URL], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ranks = {r["rank"]: r["items"] for r in result["ranks"]}
    assert sorted(ranks) == [0, 1] and ranks[0] == ranks[1]
    assert ranks[0][0]["shape"] == result["encoded"][0]["shape"] == [88, 256] and ranks[0][0]["dtype"] == "float32"
    state = httpx.get(f"{URL}/v1/requests/{result['req_id']}", timeout=30).json()
    assert state["state"] == "released" and state["received_ranks"] == [0, 1]


def _serve_cli(*args: str) -> str:
    done = subprocess.run(
        [str(pathlib.Path(sys.executable).parent / "serve"), *args], cwd=ROOT, env=_ray_env(),
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def _encoder_status() -> dict:
    """The Encoder's status and its replicas' states, from the dashboard's REST API (what
    `serve status` prints, without starting a CLI process per look)."""
    token = (pathlib.Path.home() / ".ray" / "auth_token").read_text().strip()
    answer = httpx.get(DASHBOARD + "/api/serve/applications/", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    answer.raise_for_status()
    encoder = answer.json()["applications"]["epd"]["deployments"]["Encoder"]
    states: dict[str, int] = {}
    for replica in encoder["replicas"]:
        states[replica["state"]] = states.get(replica["state"], 0) + 1
    return {"status": encoder["status"], "replica_states": states}


def test_serve_deploy_of_a_changed_config_keeps_staged_entries_and_drops_no_request(service, tmp_path):
    """Redeploy as an operator does: new Encoder replicas replace the old ones (drained)."""
    staged = httpx.post(f"{URL}/v1/encode", json={"receive_count": 2, "items": [image_item(image_bytes(224, 224, seed=2))]},
                        timeout=60).json()
    before = _decoder(service, "--req-id", staged["req_id"], "--ranks", "0")["ranks"][0]["items"]

    # Another client keeps encoding throughout the redeploy, each request deleted once answered
    # (as a decoder that gave up would), so that nothing is left staged at the end. It pauses
    # 0.1 s between requests: flat out, it would take a core from the replicas being started.
    stop, answers, deletes = threading.Event(), [], []

    def keep_encoding():
        with httpx.Client(base_url=URL, timeout=60) as client:
            for seed in itertools.count(100):
                if stop.wait(0.1):
                    return
                body = {"receive_count": 1, "items": [image_item(image_bytes(96, 96, seed=seed))]}
                answers.append(client.post("/v1/encode", json=body))
                if answers[-1].status_code == 200:
                    deletes.append(client.delete(f"/v1/requests/{answers[-1].json()['req_id']}").status_code)

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    encoder = next(d for d in config["applications"][0]["deployments"] if d["name"] == "Encoder")
    # New actor options mean new replicas; the batch size alone would be applied in place.
    encoder.update(num_replicas=2, ray_actor_options={"num_cpus": 0.5}, user_config={"max_batch_size": 4})
    (tmp_path / "changed.yaml").write_text(yaml.safe_dump(config))
    client = threading.Thread(target=keep_encoding)
    client.start()
    try:
        _serve_cli("deploy", str(tmp_path / "changed.yaml"))
        wait_until(
            lambda: (s := _encoder_status())["status"] == "HEALTHY" and s["replica_states"] == {"RUNNING": 2}, 120,
            interval_s=0.5, what="two new Encoder replicas and the old one gone",
        )
        served_before = len(answers)  # and the client goes on with the new ones alone
        wait_until(lambda: len(answers) >= served_before + 4, 60, what="encodes on the new replicas")
    finally:
        stop.set()
        client.join(timeout=120)
    assert len(answers) > 0 and [r.status_code for r in answers] == [200] * len(answers)

    # The entry staged before the redeploy is intact: rank 1 gets the bytes rank 0 got.
    after = _decoder(service, "--req-id", staged["req_id"], "--ranks", "1")["ranks"][0]["items"]
    assert after == before
    assert httpx.get(f"{URL}/v1/requests/{staged['req_id']}", timeout=30).json()["state"] == "released"
    assert deletes == [200] * len(answers)
    stats = httpx.get(f"{URL}/v1/stats", timeout=30).json()
    assert stats["staged"] == 0 and stats["pending"] == 0
