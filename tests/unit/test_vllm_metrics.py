"""RayRegistryECConnector's stats as vLLM handles them: taken per step, merged across steps,
summarised for its log line, observed into the two Prometheus histograms.

(That the scheduler and workers record them in a real engine is checked by the
``benchmarks.vllm_ttft`` quick run, which reads the histograms from vLLM's ``/metrics``.)
"""

import functools
import types

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from registry.vllm_connector import RayRegistryECConnector, RayRegistryECWorkerMetadata
from registry.engines.vllm.metrics import RegistryECStats


def test_stats_are_taken_once_and_merge_as_vllm_accumulates_them():
    stats = RegistryECStats()
    assert stats.take() is None  # nothing recorded: vLLM gets None, not an empty object
    stats.waited(0.010)
    stats.waited(0.030)
    stats.loaded(0.002)
    taken = stats.take()
    assert taken.data == {"wait_s": [0.010, 0.030], "load_s": [0.002]} and stats.is_empty()
    # The front end rebuilds each step's payload through the connector class and merges them.
    merged = RayRegistryECConnector.build_ec_connector_stats(taken.data)
    merged = merged.aggregate(RayRegistryECConnector.build_ec_connector_stats({"wait_s": [0.020], "load_s": [0.004]}))
    assert merged.reduce() == {"items": 3, "wait_ms_mean": 20.0, "wait_ms_max": 30.0, "load_steps": 2, "load_ms_mean": 3.0}
    assert taken.data == {"wait_s": [0.010, 0.030], "load_s": [0.002]}  # the payload it was built from is untouched


def test_the_histograms_observe_each_item_and_each_loading_step():
    registry = CollectorRegistry()
    kinds = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    config = types.SimpleNamespace(ec_transfer_config=None)
    prom = RayRegistryECConnector.build_prom_metrics(config, kinds, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"wait_s": [0.010, 0.030], "load_s": [0.002]}, engine_idx=0)
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:ec_registry_wait_seconds_count", labels) == 2
    assert abs(registry.get_sample_value("vllm:ec_registry_wait_seconds_sum", labels) - 0.040) < 1e-12
    assert registry.get_sample_value("vllm:ec_registry_load_seconds_count", labels) == 1


def test_ranks_loading_side_by_side_report_the_slowest():
    a = RayRegistryECWorkerMetadata(frozenset({"x"}), {}, 0.004)
    b = RayRegistryECWorkerMetadata(frozenset({"x"}), {}, 0.009)
    assert a.aggregate(b).load_s == 0.009 and a.aggregate(b).loaded == {"x"}
