"""``python -m benchmarks.decoder_paths`` with few samples: every path is measured, no speed asserted."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from support import shown_ratio

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_decoder_path_is_measured_beside_its_floors():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # it starts its own cluster
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.decoder_paths", "--rounds", "2", "--cpu-items", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,  # about 20 s here; a slow machine only measures slower
    )
    assert done.returncode == 0, done.stderr[-6000:]
    sizes = json.loads(done.stdout)["sizes"]
    assert list(sizes) == ["0.26MB", "4.72MB", "18.87MB"]
    for row in sizes.values():
        for key in ("ray_ms", "zmq_ms", "http_ms", "actor_round_trip_ms", "http_round_trip_ms"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["zmq_vs_ray"] == shown_ratio(row["zmq_ms"], row["ray_ms"])
        assert row["http_vs_ray"] == shown_ratio(row["http_ms"], row["ray_ms"])
        assert row["ingress_cpu_ms_per_mb_zmq"] >= 0 and row["ingress_cpu_ms_per_mb_http"] >= 0
