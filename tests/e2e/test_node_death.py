"""A worker node dies: its entries fail fast with ``unavailable``, the rest keep working.

The scenario (a three-node cluster on this machine) runs in its own process: see
node_death.py next to this file.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).with_name("node_death.py"))], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"outcomes"')]
    assert len(lines) == 1, done.stdout[-4000:]
    return json.loads(lines[0])


@pytest.mark.slow
def test_entries_on_the_dead_node_fail_fast_for_every_rank(report):
    for first, second in report["outcomes"]["a"]:
        # The first rank finds the objects gone as it reads them: no timeout (30 s) is waited.
        assert first["error"] == "unavailable" and "encode the request again" in first["message"], first
        assert first["seconds"] < 10
        # It told the registry, which checked and ended the entry: the next rank is told at once.
        assert second["error"] == "unavailable" and "the node holding them died" in second["message"], second
        assert second["seconds"] < 2
    assert report["all_answered_s"] < 20
    # Telling the registry of the loss, as looking it up, is awaited on the ranks' loops.
    assert report["ranks_blocked_their_loop"] == [False, False]


@pytest.mark.slow
def test_entries_elsewhere_and_new_requests_keep_working(report):
    for (first, second), expected in zip(report["outcomes"]["b"], report["expected_b"], strict=True):
        assert first["error"] is None and second["error"] is None, (first, second)
        assert first["bytes"] == second["bytes"] == expected
    assert [outcome["error"] for outcome in report["new"]] == [None, None]
    assert report["new"][0]["bytes"] == report["new"][1]["bytes"]


@pytest.mark.slow
def test_nothing_is_left_behind(report):
    stats = report["registry"]
    assert (stats["pending"], stats["staged"], stats["live_refs"], stats["staged_bytes"]) == (0, 0, 0, 0)
    assert stats["failed_total"] == 4 and stats["released_total"] == 5
    assert report["object_store"]["after"] <= report["object_store"]["baseline"]
