"""``serve run serve_config.yaml`` as a user runs it, a plain HTTP request, and the decoder example."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from support import image_bytes, image_item, wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
URL = "http://127.0.0.1:8000"  # serve_config.yaml's http_options


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _gcs_address(pgid: int) -> str | None:
    """The GCS address of the cluster that `serve run` (process group ``pgid``) started.

    Read from the command line of its processes (the raylet gets ``--gcs-address``),
    so the decoder joins that cluster and no other one running on this machine
    (``address="auto"`` may pick another).
    """
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ProcessLookupError):
            continue
        for arg in args:
            if arg.startswith("--gcs-address="):
                return arg.split("=", 1)[1]
    return None


def _healthy() -> bool:
    try:
        return httpx.get(f"{URL}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    assert _port_free(8000), "port 8000 (serve_config.yaml) is taken; stop what uses it"
    log_path = tmp_path_factory.mktemp("serve") / "serve_run.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    serve_cli = pathlib.Path(sys.executable).parent / "serve"
    with open(log_path, "wb") as log:
        # Its own session: at the end we stop exactly this process group (never `ray stop`).
        proc = subprocess.Popen(
            [str(serve_cli), "run", "serve_config.yaml"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        try:
            wait_until(lambda: proc.poll() is not None or _healthy(), 120, interval_s=0.5, what="a healthy service")
        except AssertionError:
            pytest.fail("serve run did not become healthy; its log ends:\n" + log_path.read_text()[-4000:])
        assert proc.poll() is None, log_path.read_text()[-4000:]
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the cluster serve run started
        except ProcessLookupError:
            pass
        wait_until(lambda: _port_free(8000), 30, what="port 8000 to be released")


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


def test_decoder_example_fetches_on_two_ranks(service):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    start = time.monotonic()
    # Ray 2.60 clusters require a token; a driver given an explicit address sends it only
    # when told to (with address="auto" it finds out from the local session).
    env["RAY_AUTH_MODE"] = "token"
    address = _gcs_address(service.pid)
    assert address, "no gcs_server found in serve run's process group"
    done = subprocess.run(
        [sys.executable, "examples/decoder_tp2.py", "--url", URL, "--address", address], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ranks = {r["rank"]: r["items"] for r in result["ranks"]}
    assert sorted(ranks) == [0, 1]
    assert ranks[0] == ranks[1] and ranks[0][0]["shape"] == [88, 256]
    assert ranks[0][0]["shape"] == result["encoded"][0]["shape"]
    state = httpx.get(f"{URL}/v1/requests/{result['req_id']}", timeout=30).json()
    assert state["state"] == "released" and state["received_ranks"] == [0, 1]
    assert time.monotonic() - start < 180
