"""``python -m benchmarks.scale_out`` with few samples: every figure is produced, no speed asserted."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from support import shown_ratio

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # it starts its own cluster
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale_out", "--lifecycles", "20", "--rounds", "2", "--batch", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,  # about a minute here; a slow machine only measures slower
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout)


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_every_shard_row_has_a_rate_and_the_cpu_of_each_process(report):
    rows = report["shards"]
    assert [(row["shards"], row["tp"]) for row in rows.values()] == [(1, 1), (1, 4), (2, 4), (4, 4)]
    for row in rows.values():
        assert row["fetch_errors"] == 0 and positive(row["lifecycles_per_s"])
        cpu = row["cpu_ms_per_lifecycle"]
        assert positive(cpu["all"]) and cpu["registry"] <= cpu["all"]
        assert set(cpu) == {"registry", "encoder", "ranks", "driver", "controller", "raylet", "gcs", "other", "all"}


@pytest.mark.slow
def test_fetch_many_and_the_quiet_fetch_are_measured_against_their_baselines(report):
    many = report["fetch_many"]
    assert many["shards"] == 4 and many["batch"] == 4
    assert positive(many["fetch_many_ms_per_request"]) and positive(many["fetch_async_in_flight_ms_per_request"])
    assert many["fetch_many_vs_singles"] == shown_ratio(
        many["fetch_many_ms_per_request"], many["fetch_async_in_flight_ms_per_request"])
    assert list(report["quiet_fetch"]) == ["0.26MB", "4.72MB", "18.87MB"]
    for size in report["quiet_fetch"].values():
        assert all(positive(size[k]) for k in ("round_trip_ms", "memcpy_ms", "fetch_ms"))
        assert size["fetch_vs_round_trip_plus_memcpy"] == shown_ratio(
            size["fetch_ms"], size["round_trip_ms"] + size["memcpy_ms"], den_terms=2)


@pytest.mark.slow
def test_lifecycles_through_http_and_the_handle_have_the_cpu_of_each_process(report):
    paths = report["paths"]
    assert list(paths) == ["http", "handle"]
    for path, row in paths.items():
        assert row["tp"] == 4 and row["fetch_errors"] == 0 and positive(row["lifecycles_per_s"])
        cpu = row["cpu_ms_per_lifecycle"]
        # The Ingress and the registry work on every request; Serve's proxy only for HTTP.
        assert positive(cpu["ingress"]) and positive(cpu["registry"]) and positive(cpu["encoder"]), (path, cpu)
        assert cpu["service"] == pytest.approx(cpu["all"] - cpu["driver"], abs=0.02)
        assert cpu["registry"] + cpu["ingress"] <= cpu["all"]
    assert positive(paths["http"]["cpu_ms_per_lifecycle"]["proxy"])
