"""``RayRegistryECConnector``: a vLLM engine loads the embeddings this service staged.

A vLLM encoder-cache (EC) connector for the consumer side of encoder
disaggregation. The prefill/decode instance skips its vision tower for every
item the service encoded, and each TP worker fetches the item from the registry
as its TP rank, so the registry releases it right after the last rank. Enable it
with the one flag (vLLM 0.33)::

    --ec-transfer-config '{"ec_connector": "RayRegistryECConnector",
        "ec_connector_module_path": "registry.vllm_connector", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"registry_name": "epd_registry", "registry_namespace": "epd"}}'

**Keys.** vLLM's item identifier (``request.mm_features[i].identifier``: the
``uuid`` a client puts on a chat content part, as ``deployments.EPDProxy`` does) is
the registry ``req_id`` of a one-item encode whose ``receive_count`` is the
engine's TP size.

``ec_connector_extra_config`` keys (all optional):

* ``registry_name``, ``registry_namespace``: the registry actor; default
  ``serve_config.yaml``'s (``epd_registry``, ``epd``, or ``EPD_REGISTRY_NAME`` /
  ``EPD_REGISTRY_NAMESPACE``).
* ``tp_rank``: the rank a worker fetches as when vLLM's TP group is not
  initialized (default 0); otherwise vLLM's own TP rank is used.
* ``fetch_timeout_s``: how long a worker waits for one item (default 30).
* ``watch_timeout_s``: length of the scheduler's long poll (default 5). The registry
  must answer within ``watch_timeout_s`` plus as much again (at least 5 s): a registry
  silent for longer is treated as one that cannot be reached (below).
* ``ray_address``: where a process without Ray connects, the scheduler's and each
  worker's (default ``"auto"``: under Ray Serve LLM, the cluster hosting the engine;
  see ``registry.engines.vllm.finder.cluster_address``).
* ``local_fallback``: an item the service cannot deliver (its entry failed, expired,
  was cancelled or lost before the workers were told to load it, or there is no
  registry to ask) is encoded by the engine itself, with one log line naming it
  (default true); false fails its request instead.

Scheduler side (one per engine, in the scheduler's process: ``registry.engines.vllm.scheduler``)
    Never waits on the registry while the engine has work: it is looked up on a thread of
    its own (``registry.engines.vllm.finder``), started with the engine, and a request naming
    items not heard of yet waits while that runs. When a step has nothing to run but such
    requests, it waits for the registry's next answer (bounded) instead of letting vLLM
    step an idle engine in a loop: the module says why. Never calls the registry per
    question: ``ensure_cache_available`` and ``has_cache_item`` read a local
    ``registry.engines.vllm.scheduler_view.EngineView`` that one long-poll ``watch`` call in
    flight per registry shard keeps current (checked without blocking, at most once per new
    request and once per step). ``ensure_cache_available``
    defers a request while any item it still needs is pending or not yet heard
    of; ``has_cache_item`` is True while the item is pending or staged;
    ``update_state_after_alloc`` and ``build_connector_meta`` hand the workers the
    identifiers to load with their token counts, and the items a newly scheduled
    request got from the engine's own encoder or prefix cache, for the ranks to
    acknowledge (staged for this engine, they would otherwise wait for their
    ttl); ``take_unavailable_requests`` returns the requests whose items a worker
    could not load, and, without ``local_fallback``, those whose items ended failed,
    expired, cancelled or lost, or that a stuck registry left pending (with it, the engine
    encodes those items itself).

Worker side (one per TP worker, ``registry.engines.vllm.worker``)
    ``start_load_caches`` fetches each listed identifier as this worker's TP
    rank and puts the tensor in ``encoder_cache`` on the worker's device in the
    model's dtype. An identifier already cached counts as this rank's receipt (an
    acknowledgement that reads no bytes). Fetches and acknowledgements are one
    registry call per shard for the whole step, each bounded by ``fetch_timeout_s`` (plus
    10 s for the call itself). Only the first pipeline stage loads. Each worker connects
    to Ray and looks the registry up on a thread of its own when the engine starts, so its
    first load does not. A failed load never raises, whatever failed (Ray, the lookup, the
    fetch, the bytes): the worker logs one line, leaves a zero placeholder so the step
    runs, and reports the identifier back, and the scheduler fails the request.

Stats (``registry.engines.vllm.metrics``): how long each item's request waited for it to be
staged, and how long each step's loads took; vLLM logs them and exports them to
Prometheus as ``vllm:ec_registry_wait_seconds`` and ``vllm:ec_registry_load_seconds``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from registry.engines.vllm.metadata import (
    ConnectorSettings,
    ItemLoad,
    RayRegistryECMetadata,
    RayRegistryECWorkerMetadata,
)
from registry.engines.vllm.metrics import RegistryECPromMetrics, RegistryECStats
from registry.engines.vllm.scheduler import SchedulerSide
from registry.engines.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ConnectorSettings", "ItemLoad", "RayRegistryECConnector", "RayRegistryECMetadata", "RayRegistryECWorkerMetadata"]


class RayRegistryECConnector(ECConnectorBase):
    def __init__(self, vllm_config: "VllmConfig", role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        settings = ConnectorSettings.from_extra_config(vllm_config.ec_transfer_config.ec_connector_extra_config)
        # With more than one pipeline stage an empty step may have a batch in flight: never wait then.
        one_stage = vllm_config.parallel_config.pipeline_parallel_size == 1
        self._scheduler = SchedulerSide(settings, one_stage) if role == ECConnectorRole.SCHEDULER else None
        self._worker = WorkerSide(vllm_config, settings) if role == ECConnectorRole.WORKER else None

    # ==============================
    # Worker-side methods
    # ==============================

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, RayRegistryECMetadata) and self._worker is not None
        self._worker.load(metadata.loads, encoder_cache)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        return None  # a consumer: the encoder service produces

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        report = self._worker.take_report() if self._worker is not None else None
        return RayRegistryECWorkerMetadata(*report) if report is not None else None

    # ==============================
    # Scheduler-side methods
    # ==============================

    def has_cache_item(self, identifier: str) -> bool:
        return self._scheduler is not None and self._scheduler.view.has(identifier)

    def ensure_cache_available(self, request: "Request", num_computed_tokens: int) -> bool:
        assert self._scheduler is not None
        return self._scheduler.ensure(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", index: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> ECConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def take_unavailable_requests(self) -> set[str]:
        return self._scheduler.take_unavailable() if self._scheduler is not None else set()

    def update_connector_output(self, connector_output: "ECConnectorOutput") -> None:
        meta = connector_output.ec_connector_worker_meta
        if self._scheduler is not None and isinstance(meta, RayRegistryECWorkerMetadata):
            self._scheduler.view.loaded(meta.loaded)
            self._scheduler.view.load_failed(meta.failed)
            if meta.load_s:
                self._scheduler.stats.loaded(meta.load_s)

    def get_ec_connector_stats(self) -> RegistryECStats | None:
        return self._scheduler.stats.take() if self._scheduler is not None else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> RegistryECStats:
        return RegistryECStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> RegistryECPromMetrics:
        return RegistryECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.finish(request.request_id)
        return False, None
