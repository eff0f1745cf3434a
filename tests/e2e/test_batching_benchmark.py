"""``python -m benchmarks.batching`` with few samples: both variants on both paths are measured,
one call each really is one call each; no speed asserted."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_batched_and_single_calls_are_measured_side_by_side():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # it starts its own cluster
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.batching", "--lifecycles", "40", "--concurrency", "16", "--rounds", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,  # about 40 s here; a slow machine only measures slower
    )
    assert done.returncode == 0, done.stderr[-6000:]
    out = json.loads(done.stdout)
    assert out["settings"]["variants"]["single"] == {"encoder_call_max_items": 1, "registry_call_max_requests": 1}
    by_path = out["concurrency_16"]
    assert sorted(by_path) == ["handle", "http"]
    for row in by_path.values():
        single, batched = row["single"], row["batched"]
        # One call each: exactly one item per Encoder call and one request per submit call.
        assert single["items_per_encoder_call"] == single["requests_per_submit_call"] == 1.0
        assert batched["items_per_encoder_call"] >= 1.0 and batched["requests_per_submit_call"] >= 1.0
        for variant in (single, batched):
            for key in ("service_ms", "registry_ms", "ingress_ms", "encoder_ms", "ranks_ms", "lifecycles_per_s"):
                assert math.isfinite(variant[key]) and variant[key] > 0, (key, variant)
        assert row["batched_vs_single"]["service_ms"] == pytest.approx(batched["service_ms"] / single["service_ms"], abs=0.01)
