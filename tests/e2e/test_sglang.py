"""SGLang 0.5.23's own language-side code, unmodified, against ``serve run serve_config.yaml``.

``tests/sglang_ranks.py`` runs in SGLang's own venv (``tests/sglang_env.py``, built on
first use): SGLang's tokenizer-side ``/encode`` dispatch, and two scheduler TP ranks in
one gloo group running ``MMReceiverHTTP`` / ``WaitingZmqRequest``, pointed at
``http://127.0.0.1:8000/sglang``. Only SGLang's multimodal processor is stood in for
(it would need the model's processor files); it records what SGLang hands it.
"""

import hashlib
import json
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

import sglang_env
from process_groups import ROOT
from serve_run import URL
from support import data_url, image_bytes, one_thread, reference_embedding, shown_ratio

SGLANG_URL = f"{URL}/sglang"
# serve_config.yaml's tower: the tiny seeded Qwen2.5-VL one, float32 on a CPU.
SPEC = {"family": "qwen2_5_vl"}
PHOTO = image_bytes(224, 160, seed=301, fmt="JPEG")
SMALL = [image_bytes(96, 96, seed=302), image_bytes(64, 128, seed=303)]


def _digest(*arrays: np.ndarray) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


with one_thread():
    REFERENCE = {name: reference_embedding(data, **SPEC) for name, data in [("photo", PHOTO), ("a", SMALL[0]), ("b", SMALL[1])]}


@pytest.fixture(scope="module")
def sglang_python():
    try:
        return sglang_env.ensure_sglang_python()
    except sglang_env.SglangEnvError as exc:
        pytest.skip(f"SGLang {sglang_env.SGLANG_VERSION} could not be installed in its own venv: {exc}")


def run_ranks(python: str, backend: str, requests: list[dict], tmp_path) -> dict[str, dict]:
    """Run the TP=2 ranks on ``requests``; each request's result by rid."""
    (tmp_path / "requests.json").write_text(json.dumps(requests))
    done = subprocess.run(
        [python, str(ROOT / "tests" / "sglang_ranks.py"), "--encoder-url", SGLANG_URL, "--backend", backend,
         "--tp", "2", "--requests", str(tmp_path / "requests.json"), "--out", str(tmp_path / "results.json"),
         "--timeout-s", "240"],
        cwd=ROOT, env=sglang_env.script_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["harness_error"] is None, results["harness_error"]
    return {request["rid"]: request for request in results["requests"]}


@pytest.fixture(scope="module")
def scheduler_run(service, sglang_python, tmp_path_factory):
    """zmq_to_scheduler (SGLang's default): one photo, two images in two parts, a corrupt image."""
    requests = [
        {"rid": "sgl-photo", "images": [data_url(PHOTO, "image/jpeg")], "parts": 1},
        {"rid": "sgl-two", "images": [data_url(d) for d in SMALL], "parts": 2},
        {"rid": "sgl-corrupt", "images": [data_url(SMALL[0][:300])], "parts": 1},
    ]
    return run_ranks(sglang_python, "zmq_to_scheduler", requests, tmp_path_factory.mktemp("sglang"))


def entry(req_id: str) -> dict:
    return httpx.get(f"{URL}/v1/requests/{req_id}", timeout=30).json()


def test_both_ranks_admit_bitwise_the_services_embedding(scheduler_run):
    result = scheduler_run["sgl-photo"]
    staged = entry("sgl-photo_local_part_0")
    assert result["all_admitted"] and len(result["ranks"]) == 2
    for rank in result["ranks"]:
        got = rank["embeddings"]["IMAGE"]
        assert got["sha256"] == _digest(REFERENCE["photo"]), rank
        assert got["dtype"] == "float32" and got["shape"] == list(REFERENCE["photo"].shape)
        assert rank["img_grid_thw"] == [staged["items"][0]["grid_thw"]]
    t, h, w = staged["items"][0]["grid_thw"]
    assert REFERENCE["photo"].shape[0] == t * h * w // 4  # Qwen2.5-VL merges 2x2 patches per token


def test_the_entry_is_released_after_the_second_rank(scheduler_run):
    staged = entry("sgl-photo_local_part_0")
    assert (staged["state"], staged["receive_count"], staged["received_ranks"]) == ("released", 2, [0, 1])


def test_a_late_registration_is_refused_at_once(scheduler_run):
    started = time.monotonic()
    late = httpx.post(f"{SGLANG_URL}/scheduler_receive_url", timeout=30, json={
        "req_id": "sgl-photo_local_part_0", "receive_count": 2, "receive_url": "127.0.0.1:1", "modality": "IMAGE",
    })
    assert late.status_code == 410 and "released" in late.json()["message"]
    assert time.monotonic() - started < 5


def test_a_corrupt_image_makes_both_ranks_abort_with_the_services_text(scheduler_run):
    result = scheduler_run["sgl-corrupt"]
    assert [rank["status"] for rank in result["ranks"]] == ["aborted", "aborted"]
    messages = {rank["error_msg"] for rank in result["ranks"]}
    assert len(messages) == 1 and "items[0]" in messages.pop()
    assert entry("sgl-corrupt_local_part_0")["state"] == "failed"


def test_two_images_in_two_parts_join(scheduler_run):
    result = scheduler_run["sgl-two"]
    grids = [entry(f"sgl-two_local_part_{k}")["items"][0]["grid_thw"] for k in range(2)]
    assert result["all_admitted"]
    for rank in result["ranks"]:
        assert rank["embeddings"]["IMAGE"]["sha256"] == _digest(REFERENCE["a"], REFERENCE["b"])
        assert rank["img_grid_thw"] == grids
    for k in range(2):
        assert entry(f"sgl-two_local_part_{k}")["received_ranks"] == [0, 1]


def test_zmq_to_tokenizer_delivers_the_one_copy(service, sglang_python, tmp_path):
    requests = [{"rid": "sgl-tokenizer", "images": [data_url(SMALL[1])], "parts": 1}]
    result = run_ranks(sglang_python, "zmq_to_tokenizer", requests, tmp_path)["sgl-tokenizer"]
    assert result["all_admitted"]
    assert {rank["embeddings"]["IMAGE"]["sha256"] for rank in result["ranks"]} == {_digest(REFERENCE["b"])}
    stats = httpx.get(f"{URL}/v1/stats", timeout=30).json()
    assert stats["staged"] == 0 and stats["pending"] == 0


def test_the_benchmark_against_sglangs_own_server_reports_every_figure(sglang_python):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.sglang", "--requests", "2", "--sizes", "0.26"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout)["sizes"]["0.26MB"]
    for target in ("service", "sglang"):
        assert figures[f"{target}_ms"] > 0 and figures[f"{target}_cpu_ms"] is not None
    assert figures["time_ratio"] == shown_ratio(figures["service_ms"], figures["sglang_ms"])
