"""``python -m benchmarks --quick`` as CI runs it: every figure is produced and the schema holds.

A smoke test: it asserts nothing about speed (no figure is compared with a time or
a target), only that the run completes, that results.json is complete and well
formed, and that the Markdown table and the two PNG plots are written.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SIZES_MB = ("0.52", "4.72", "18.87")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # As test_serve_run does: the benchmark starts its own cluster, so no inherited address.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--no-progress", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # about 1-2 minutes here; a slow machine only measures slower
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_results_json_holds_the_schema(quick_run):
    from benchmarks.schema import SCHEMA_VERSION, validate

    _, doc = quick_run
    assert validate(doc) == []
    assert doc["schema_version"] == SCHEMA_VERSION and doc["mode"] == "quick" and "errors" not in doc
    assert {"cpu_count", "ram_bytes", "python", "torch", "ray", "gpu"} <= set(doc["machine"])
    assert doc["summary"]["targets_total"] == len(doc["targets"]) > 0


@pytest.mark.slow
def test_every_figure_of_the_report_is_present_and_numeric(quick_run):
    _, doc = quick_run
    figures = doc["figures"]

    def value(name, **labels):
        matches = [
            f
            for f in figures.values()
            if f"{f['section']}.{f['name']}" == name
            and all(str(f["labels"].get(k)) == str(v) for k, v in labels.items())
        ]
        assert matches, f"no figure {name} {labels}"
        for f in matches:
            assert isinstance(f["value"], (int, float)) and math.isfinite(f["value"]), f
            assert f["unit"], f
        return matches[0]["value"]

    for size in SIZES_MB:  # 1. fetch and its baselines
        for name in ("fetch.registry_fetch_s", "fetch.zmq_s", "fetch.memcpy_warm_s", "fetch.actor_rtt_s"):
            assert value(name, size_mb=size) > 0
    for prealloc in ("off", "on"):  # 2. staging per MB, against ray.put and memcpy
        for name in ("staging.staging_s_per_mb", "staging.put_s_per_mb", "staging.memcpy_warm_s_per_mb"):
            value(name, prealloc=prealloc)
    assert value("registry.lifecycles_per_s") > 0 and value("registry.raw_calls_per_s") > 0  # 3.
    assert value("registry.registry_calls_per_lifecycle") >= 1
    for model in ("tiny", "vit_b"):  # 4. served and in-process throughput
        assert value("e2e.inprocess_forward_images_per_s", model=model) > 0
        for path in ("handle", "http"):
            assert value("e2e.saturated_images_per_s", model=model, path=path) > 0
    for path in ("handle", "http"):  # 5. per path
        assert value("memory.peak_store_bytes_above_baseline", path=path) > 0
        assert value("memory.staged_bytes", path=path) > 0
        value("memory.bytes_left_after_release", path=path)
    for shards, tp in ((1, 1), (1, 4), (2, 4), (4, 4)):  # 6. the scale-out rows
        assert value("scale.lifecycles_per_s", shards=shards, tp=tp) > 0
        assert value("scale.cpu_s_per_lifecycle", shards=shards, tp=tp, process="all") > 0
    assert value("scale.fetch_many_s_per_request", shards=4) > 0
    for size in SIZES_MB:
        assert value("scale.quiet_fetch_s", size_mb=size) > 0
    for f in figures.values():  # distributions carry their percentiles and sample counts
        if "stats" in f:
            assert f["stats"]["n"] >= 1 and f["stats"]["p99"] >= f["stats"]["p50"] == f["value"]
    sections = {t["section"] for t in doc["targets"]}
    assert sections == {"fetch", "staging", "registry", "scale", "memory", "e2e"}
    assert all(isinstance(t["met"], bool) and math.isfinite(t["value"]) for t in doc["targets"])


@pytest.mark.slow
def test_markdown_table_and_png_plots_are_written(quick_run):
    out, doc = quick_run
    md = (out / "results.md").read_text()
    assert "| section | target | labels | measured | required | met |" in md
    assert md.index("## Targets") < md.index("## Ratios") < md.index("## Figures")  # ratios first
    target_rows = [
        line
        for line in md.splitlines()
        if line.startswith(("| fetch |", "| staging |", "| registry |", "| scale |", "| memory |", "| e2e |"))
    ]
    assert len(target_rows) == len(doc["targets"])
    for name in ("latency_vs_size.png", "throughput_vs_concurrency.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
