"""``python -m benchmarks --quick``, run once as CI runs it: every section and every figure the docs
quote (docs/performance.md, docs/decoders.md) is reported with a sane value.

No speed is asserted: no figure is compared with a time or a target. What is: the run
completes with no section failing; each quoted figure exists and is a finite number, positive
where a time, a rate or a size must be; each ratio is the quotient of the figures it names;
the counts that are exact are exact (calls per lifecycle, one item per call with batching
off, the bytes a burst staged, the ViT-B tower's size); every target is judged; results.md
has a row per target.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks.report import figure_id
from benchmarks.runner import QUICK, RECEIVE_COUNT, SECTIONS, SIZES

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIZES_MB = ("0.52", "4.72", "18.87")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # it starts a cluster of its own
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=900,  # 1-3 minutes here; a loaded machine only measures slower
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return out, json.loads((out / "results.json").read_text())


def figure(doc, section, name, positive=True, **labels):
    """The value of one figure, checked to be a finite number (and positive, unless told)."""
    key = figure_id(section, name, labels)
    assert key in doc["figures"], f"no figure {key}"
    value = doc["figures"][key]["value"]
    assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)
    assert value > 0 if positive else True, (key, value)
    return value


def targets(doc, section):
    return {t["id"]: t for t in doc["targets"] if t["section"] == section}


def test_every_section_runs_and_every_target_is_judged(run):
    out, doc = run
    assert doc["errors"] == {} and doc["mode"] == "quick" and doc["sections"] == list(SECTIONS)
    assert {t["section"] for t in doc["targets"]} == {"fetch", "staging", "registry", "ingress", "memory", "e2e"}
    for target in doc["targets"]:
        assert isinstance(target["met"], bool) and math.isfinite(target["value"]), target
    for f in doc["figures"].values():  # distributions carry their p99 and sample count
        assert "p99" not in f or (f["p99"] >= f["value"] and f["n"] >= 1), f
    md = (out / "results.md").read_text()
    assert all(f"`{t['id']}`" in md for t in doc["targets"])
    assert all(f"\n## {section}\n" in md for section in SECTIONS)


def test_fetch_each_way_beside_its_floors(run):
    _, doc = run
    for size in SIZES_MB:
        times = {name: figure(doc, "fetch", f"{name}_s", size_mb=size) for name in (
            "fetch", "round_trip", "memcpy", "zmq_baseline", "zmq_fetch", "http_pull", "http_round_trip")}
        for path in ("zmq", "http"):
            assert figure(doc, "fetch", "ingress_cpu_s_per_mb", positive=False, path=path, size_mb=size) >= 0
        assert figure(doc, "fetch", "fetch_vs_round_trip_plus_memcpy", size_mb=size) == pytest.approx(
            times["fetch"] / (times["round_trip"] + times["memcpy"]))
        assert figure(doc, "fetch", "fetch_vs_zmq_baseline", size_mb=size) == pytest.approx(
            times["fetch"] / times["zmq_baseline"])
    judged = targets(doc, "fetch")
    for size in SIZES_MB:
        assert figure_id("fetch", "fetch_vs_round_trip_plus_memcpy", {"size_mb": size}) in judged
        assert judged[figure_id("fetch", "bf16_zero_copy", {"size_mb": size})]["met"], "a fetch was not a bf16 view"
    assert {t for t in judged if "zmq" in t} == {figure_id("fetch", "fetch_vs_zmq_baseline", {"size_mb": s})
                                                 for s in ("4.72", "18.87")}


def test_staging_per_mb_against_put_and_memcpy(run):
    _, doc = run
    slopes = {name: figure(doc, "staging", f"{name}_s_per_mb", positive=False) for name in ("staging", "put", "memcpy")}
    assert figure(doc, "staging", "staging_per_mb_vs_put", positive=False) == pytest.approx(slopes["staging"] / slopes["put"])
    assert figure(doc, "staging", "put_s", size_mb="75.50") > 0
    assert targets(doc, "staging")["staging.copies_before_store"]["met"], "building the staged item copied it"


def test_registry_lifecycles_against_raw_calls(run):
    _, doc = run
    top = max(QUICK.registry_concurrency)
    raw = figure(doc, "registry", "raw_calls_per_s", concurrency=top)
    life = figure(doc, "registry", "lifecycles_per_s", concurrency=top)
    serve_rate = figure(doc, "registry", "serve_calls_per_s", concurrency=top)
    calls = figure(doc, "registry", "registry_calls_per_lifecycle")
    assert RECEIVE_COUNT + 1 <= calls < RECEIVE_COUNT + 2, "a lifecycle is 1 submit + 4 fetches, without polling"
    assert figure(doc, "registry", "fetch_errors", positive=False) == 0
    assert figure(doc, "registry", "lifecycles_vs_raw_per_call", concurrency=top) == pytest.approx(life * calls / raw)
    assert figure(doc, "registry", "lifecycles_vs_raw_with_serve_call", concurrency=top) == pytest.approx(
        life * (calls / raw + 1 / serve_rate))
    for process in ("peer", "driver"):
        figure(doc, "registry", "cpu_s_per_raw_call", positive=False, concurrency=top, process=process)
    for process in ("all", "registry", "ranks"):
        figure(doc, "registry", "cpu_s_per_lifecycle", concurrency=top, process=process)


def test_scale_rows_and_fetch_many(run):
    _, doc = run
    for shards, tp in ((1, 1), (1, 4), (2, 4), (4, 4)):
        figure(doc, "scale", "lifecycles_per_s", shards=shards, tp=tp)
        assert figure(doc, "scale", "fetch_errors", positive=False, shards=shards, tp=tp) == 0
        cpu = {p: figure(doc, "scale", "cpu_s_per_lifecycle", process=p, shards=shards, tp=tp) for p in ("all", "registry")}
        assert cpu["registry"] <= cpu["all"]
    labels = {"shards": 4, "batch": QUICK.scale_batch}
    many = figure(doc, "scale", "fetch_many_s_per_request", **labels)
    in_flight = figure(doc, "scale", "fetch_in_flight_s_per_request", **labels)
    assert figure(doc, "scale", "fetch_many_vs_in_flight", **labels) == pytest.approx(many / in_flight)


def test_ingress_batched_and_single_on_both_paths(run):
    _, doc = run
    concurrency = QUICK.ingress_concurrency[0]
    cpu = {}
    for variant in ("batched", "single"):
        for path in ("http", "handle"):
            labels = {"variant": variant, "path": path, "concurrency": concurrency}
            figure(doc, "ingress", "lifecycles_per_s", **labels)
            assert figure(doc, "ingress", "fetch_errors", positive=False, **labels) == 0
            items = figure(doc, "ingress", "items_per_encoder_call", **labels)
            requests = figure(doc, "ingress", "requests_per_submit_call", **labels)
            assert (items, requests) == (1, 1) if variant == "single" else items >= 1 and requests >= 1, (items, requests)
            cpu[variant, path] = {p: figure(doc, "ingress", "cpu_s_per_lifecycle", positive=False, process=p, **labels)
                                  for p in ("all", "driver", "service", "registry", "ingress", "encoder", "proxy")}
            got = cpu[variant, path]
            assert got["service"] == pytest.approx(got["all"] - got["driver"])
            assert got["registry"] > 0 and got["ingress"] > 0 and got["service"] > 0
        assert cpu[variant, "http"]["proxy"] > 0  # Serve's proxy works only for HTTP
    for path in ("http", "handle"):
        assert figure(doc, "ingress", "batched_vs_single_cpu", path=path, concurrency=concurrency, process="service") == \
            pytest.approx(cpu["batched", path]["service"] / cpu["single", path]["service"])
    assert len(targets(doc, "ingress")) == 4  # service and registry, both paths


def test_memory_burst_per_path(run):
    _, doc = run
    for path in ("handle", "http"):
        staged = figure(doc, "memory", "staged_bytes", path=path)
        assert staged == QUICK.memory_burst * SIZES[1]
        peak = figure(doc, "memory", "peak_store_bytes_above_baseline", path=path)
        assert figure(doc, "memory", "peak_per_staged_byte", path=path) == pytest.approx(peak / staged)
        figure(doc, "memory", "extra_peak_per_input_byte", positive=False, path=path)
        figure(doc, "memory", "bytes_left_after_release", positive=False, path=path)
        assert figure_id("memory", "returns_to_baseline", {"path": path}) in targets(doc, "memory")


def test_end_to_end_served_against_in_process(run):
    _, doc = run
    assert 80e6 < figure(doc, "e2e", "model_parameters", model="vit_b") < 95e6
    for model in ("tiny", "vit_b"):
        runs = [figure(doc, "e2e", "inprocess_forward_images_per_s", model=model, when=w) for w in ("before", "after")]
        best = figure(doc, "e2e", "inprocess_forward_images_per_s", model=model, when="best")
        assert best == max(runs)
        for path in ("handle", "http"):
            labels = {"model": model, "path": path}
            saturated = figure(doc, "e2e", "saturated_images_per_s", **labels)
            assert saturated == max(figure(doc, "e2e", "images_per_s", concurrency=c, **labels)
                                    for c in QUICK.e2e_concurrency)
            figure(doc, "e2e", "latency_s", concurrency=QUICK.e2e_concurrency[-1], **labels)
            encoder = figure(doc, "e2e", "cpu_s_per_image", process="encoder", **labels)
            assert figure(doc, "e2e", "cpu_s_per_image", process="all", **labels) >= encoder
            assert figure(doc, "e2e", "served_vs_inprocess", **labels) == pytest.approx(saturated / best)
    assert len(targets(doc, "e2e")) == 2  # ViT-B, both paths
