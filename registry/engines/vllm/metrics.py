"""Where an E+PD request's time goes inside the engine: ``RayRegistryECConnector``'s stats.

Two durations, each measured inside one process (the scheduler's and the workers' clocks
are never compared):

* ``wait_s``, per item loaded from the service: from the scheduler step that first sees
  the request naming it (``ensure_cache_available``) to the step that hands the staged
  item to the workers (``update_state_after_alloc``). The request waits here for the
  service's encode, and for a step with room for it.
* ``load_s``, per engine step that loads items: a worker's ``fetch_many`` of the step's
  items and their placement in ``encoder_cache`` (the slowest TP rank's, as the step
  waits for it). It reaches the scheduler in the connector's worker metadata, since
  vLLM's V1 model runner does not forward worker-side connector stats.

Their sum is the connector's share of a request's time to first token, up to the hand-off
of the step's scheduler output to the workers. vLLM takes them every step
(``get_ec_connector_stats``); with stats on (its OpenAI server's default) it logs a summary
every log interval, ``EC Transfer metrics: items=..., wait_ms_mean=..., ...``, and exports
two Prometheus histograms: ``vllm:ec_registry_wait_seconds`` and
``vllm:ec_registry_load_seconds`` (labels ``model_name``, ``engine``). Recording costs a
clock read and a list append per item and per loading step.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats

# Seconds: from an item staged before the request arrived (a step or less) to a cold encode
# queued behind others (seconds).
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A step's fetch: about one registry round trip, plus the copy to the device.
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class RegistryECStats(ECConnectorStats):
    """``data``: ``{"wait_s": [seconds per item], "load_s": [seconds per loading step]}``.
    Plain lists of floats, so vLLM ships them from the engine core to its front end."""

    def __init__(self, data: dict[str, Any] | None = None):
        super().__init__(data={"wait_s": list((data or {}).get("wait_s", ())), "load_s": list((data or {}).get("load_s", ()))})

    def reset(self) -> None:
        self.data = {"wait_s": [], "load_s": []}

    def aggregate(self, other: ECConnectorStats) -> "RegistryECStats":
        if isinstance(other, RegistryECStats):
            self.data["wait_s"].extend(other.data["wait_s"])
            self.data["load_s"].extend(other.data["load_s"])
        return self

    def reduce(self) -> dict[str, int | float]:
        wait, load = self.data["wait_s"], self.data["load_s"]
        return {
            "items": len(wait),
            "wait_ms_mean": round(1e3 * sum(wait) / len(wait), 3) if wait else 0.0,
            "wait_ms_max": round(1e3 * max(wait), 3) if wait else 0.0,
            "load_steps": len(load),
            "load_ms_mean": round(1e3 * sum(load) / len(load), 3) if load else 0.0,
        }

    def is_empty(self) -> bool:
        return not self.data["wait_s"] and not self.data["load_s"]

    # The scheduler side's recording (its own process, one thread).

    def waited(self, seconds: float) -> None:
        self.data["wait_s"].append(seconds)

    def loaded(self, seconds: float) -> None:
        self.data["load_s"].append(seconds)

    def take(self) -> "RegistryECStats | None":
        """What was recorded since the last call (None if nothing), and start afresh."""
        if self.is_empty():
            return None
        taken = RegistryECStats(self.data)
        self.reset()
        return taken


class RegistryECPromMetrics(ECConnectorPromMetrics):
    """The two histograms, one child per engine (vLLM's per-connector metrics contract)."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        wait = self._histogram_cls(
            name="vllm:ec_registry_wait_seconds", labelnames=labelnames, buckets=list(WAIT_BUCKETS),
            documentation="Per item loaded from the encoder service: from the scheduler first seeing its "
                          "request to handing the staged item to the workers.",
        )
        load = self._histogram_cls(
            name="vllm:ec_registry_load_seconds", labelnames=labelnames, buckets=list(LOAD_BUCKETS),
            documentation="Per engine step that loads items from the encoder service: the slowest worker's "
                          "fetch and placement in its encoder cache.",
        )
        self._wait = create_metric_per_engine(wait, per_engine_labelvalues)
        self._load = create_metric_per_engine(load, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for seconds in transfer_stats_data.get("wait_s", ()):
            self._wait[engine_idx].observe(seconds)
        for seconds in transfer_stats_data.get("load_s", ()):
            self._load[engine_idx].observe(seconds)

