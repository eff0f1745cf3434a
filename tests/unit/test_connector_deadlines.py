"""Joining a Ray cluster that is not there can hang for minutes (``ray.init`` keeps retrying).
The connector's two sides still answer within their deadlines, in a process of their own
without Ray, as vLLM's engine core and ``mp`` workers are:

* the scheduler's ``RegistryFinder`` says it failed once its lookup has taken ``timeout_s``
  (the scheduler then lets the engine encode items nobody could have staged);
* a worker's load reports each item failed, leaves its placeholder and returns, after
  waiting for the connection once (``fetch_timeout_s``); the next load returns at once.
"""

import json
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parents[1]
NOWHERE = "127.0.0.1:1"  # nothing listens there

SCRIPT = r"""
import json, os, sys, tempfile, time
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
sys.path.insert(0, sys.argv[1])
from registry.engines.vllm.finder import RegistryFinder

finder = RegistryFinder("epd_registry", "epd", sys.argv[2], timeout_s=2.0)
started = time.monotonic()
while finder.shards() is None and not finder.failed and time.monotonic() - started < 30:
    time.sleep(0.1)
finder_s, finder_failed = time.monotonic() - started, finder.failed

import torch
import vllm_env
from registry.engines.vllm.metadata import ConnectorSettings, ItemLoad
from registry.engines.vllm.worker import WorkerSide

folder = tempfile.mkdtemp()
vllm_env.save_tiny_qwen_for_vllm(folder)
extra = {"ray_address": sys.argv[2], "fetch_timeout_s": 2.0}
cfg = vllm_env.make_vllm_config(folder, ec_connector="RayRegistryECConnector", module_path="registry.vllm_connector",
                                extra_config=extra, dtype="float32")
worker = WorkerSide(cfg, ConnectorSettings.from_extra_config(extra))
cache, loads = {}, []
for identifier in ("first", "second"):
    started = time.monotonic()
    worker.load((ItemLoad(identifier, 4),), cache)
    loaded, failed, _ = worker.take_report()
    loads.append({"s": time.monotonic() - started, "failed": sorted(failed), "why": failed[identifier],
                  "placeholder": list(cache[identifier].shape), "zeros": bool((cache[identifier] == 0).all())})
print("RESULT " + json.dumps({"finder_s": finder_s, "finder_failed": finder_failed, "loads": loads}), flush=True)
os._exit(0)  # the connecting threads are still trying: do not wait for them
"""


@pytest.mark.timeout(180)
def test_an_unreachable_cluster_is_reported_within_the_deadlines_and_never_raises_out_of_a_load():
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(TESTS), NOWHERE], capture_output=True, text=True, timeout=170,
                          cwd=TESTS.parent)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["finder_failed"] and 2.0 <= result["finder_s"] < 20, result
    first, second = result["loads"]
    assert first["failed"] == ["first"] and "connecting to the registry has taken over 2 s" in first["why"], first
    assert first["placeholder"][0] == 4 and first["zeros"], first  # the step runs on a zero placeholder
    assert 2.0 <= first["s"] < 20, first  # waited for the connection once, as long as a fetch may take
    assert second["failed"] == ["second"] and second["s"] < 1.0, second  # then fails at once while it hangs
