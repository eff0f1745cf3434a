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
* ``watch_timeout_s``: length of the scheduler's long poll (default 5).
* ``ray_address``: where a process without Ray connects, the scheduler's and each
  worker's (default ``"auto"``: under Ray Serve LLM, the cluster hosting the engine;
  see ``registry.engines.vllm.finder.cluster_address``).
* ``local_fallback``: an item the service cannot deliver (its entry failed, expired,
  was cancelled or lost before the workers were told to load it, or there is no
  registry to ask) is encoded by the engine itself, with one log line naming it
  (default true); false fails its request instead.

Scheduler side (one per engine, in the scheduler's process)
    Never waits on the registry: it is looked up on a thread of its own
    (``registry.engines.vllm.finder``), and a request naming items not heard of yet waits
    while that runs. Never calls the registry per question: ``ensure_cache_available`` and
    ``has_cache_item`` read a local ``registry.engines.vllm.scheduler_view.EngineView`` that one
    long-poll ``watch`` call in flight keeps current (checked without blocking,
    at most once per new request and once per step). ``ensure_cache_available``
    defers a request while any item it still needs is pending or not yet heard
    of; ``has_cache_item`` is True while the item is pending or staged;
    ``update_state_after_alloc`` and ``build_connector_meta`` hand the workers the
    identifiers to load with their token counts, and the items a newly scheduled
    request got from the engine's own encoder or prefix cache, for the ranks to
    acknowledge (staged for this engine, they would otherwise wait for their
    ttl); ``take_unavailable_requests`` returns the requests whose items a worker
    could not load, and, without ``local_fallback``, those whose items ended failed,
    expired, cancelled or lost (with it, the engine encodes those items itself).

Worker side (one per TP worker, ``registry.engines.vllm.worker``)
    ``start_load_caches`` fetches each listed identifier as this worker's TP
    rank and puts the tensor in ``encoder_cache`` on the worker's device in the
    model's dtype. An identifier already cached counts as this rank's receipt (an
    acknowledgement that reads no bytes). Fetches and acknowledgements are one
    registry call per shard for the whole step. Only the first pipeline stage loads. A
    failed fetch never raises: the worker logs one line, leaves a zero
    placeholder so the step runs, and reports the identifier back, and the
    scheduler fails the request.

Stats (``registry.engines.vllm.metrics``): how long each item's request waited for it to be
staged, and how long each step's loads took; vLLM logs them and exports them to
Prometheus as ``vllm:ec_registry_wait_seconds`` and ``vllm:ec_registry_load_seconds``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from registry.checks import check_rank, check_seconds
from registry.engines.vllm.scheduler_view import EngineView
from registry.engines.vllm.finder import RegistryFinder
from registry.engines.vllm.metrics import RegistryECPromMetrics, RegistryECStats
from registry.engines.vllm.worker import WorkerSide
from registry.settings import registry_address

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's own logger, so its logging configuration (level, format) covers these lines.
logger = logging.getLogger("vllm.ec_connector.ray_registry")

# How often a scheduler that cannot find the registry looks for it again.
_LOOKUP_RETRY_S = 1.0


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """``ec_connector_extra_config``, validated (see the module docstring)."""

    registry_name: str
    registry_namespace: str
    tp_rank: int = 0
    fetch_timeout_s: float = 30.0
    watch_timeout_s: float = 5.0
    ray_address: str = "auto"
    local_fallback: bool = True

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        name, namespace = registry_address(extra.pop("registry_name", None), extra.pop("registry_namespace", None))
        keys = ("tp_rank", "fetch_timeout_s", "watch_timeout_s", "ray_address", "local_fallback")
        settings = cls(name, namespace, **{k: extra.pop(k) for k in keys if k in extra})
        if extra:
            logger.warning("ec_connector_extra_config keys %s are not RayRegistryECConnector's; ignored", sorted(extra))
        if not isinstance(settings.local_fallback, bool):
            raise ValueError(f"ec_connector_extra_config.local_fallback must be true or false, got {settings.local_fallback!r}")
        check_rank(settings.tp_rank, ValueError, "ec_connector_extra_config.tp_rank")
        for key in ("fetch_timeout_s", "watch_timeout_s"):
            check_seconds(getattr(settings, key), ValueError, f"ec_connector_extra_config.{key}", allow_zero=False)
        return settings


@dataclasses.dataclass(frozen=True, slots=True)
class ItemLoad:
    identifier: str
    num_tokens: int
    reload: bool = False  # over a placeholder a failed load left in the worker's cache
    # The engine needs no bytes (its own encoder cache or prefix cache had the item): each
    # rank only acknowledges, so the entry is released instead of waiting for its ttl.
    acknowledge_only: bool = False


@dataclasses.dataclass(frozen=True)
class RayRegistryECMetadata(ECConnectorMetadata):
    """Scheduler -> workers, once per step: what to load. Pickles (vLLM ships it to Ray workers)."""

    loads: tuple[ItemLoad, ...] = ()


@dataclasses.dataclass(frozen=True)
class RayRegistryECWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: identifiers loaded, and the ones that failed (-> why)."""

    loaded: frozenset[str] = frozenset()
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    load_s: float = 0.0  # this step's fetch and placement; 0 if it fetched nothing

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        if not isinstance(other, RayRegistryECWorkerMetadata):
            return self
        # The ranks load side by side and the step waits for the slowest.
        return RayRegistryECWorkerMetadata(self.loaded | other.loaded, {**self.failed, **other.failed},
                                           max(self.load_s, other.load_s))


class RayRegistryECConnector(ECConnectorBase):
    def __init__(self, vllm_config: "VllmConfig", role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        settings = ConnectorSettings.from_extra_config(vllm_config.ec_transfer_config.ec_connector_extra_config)
        self._scheduler = _SchedulerSide(settings) if role == ECConnectorRole.SCHEDULER else None
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


class _SchedulerSide:
    def __init__(self, settings: ConnectorSettings):
        self.settings = settings
        self.view = EngineView(settings.local_fallback)
        self._finder = RegistryFinder(
            settings.registry_name, settings.registry_namespace, settings.ray_address, _LOOKUP_RETRY_S,
            owner="RayRegistryECConnector: ",
        )
        self._watches: dict[int, Any] = {}  # registry shard -> the ObjectRef of its watch call in flight
        self._num_tokens: dict[str, int] = {}  # identifier -> its tokens, while a request names it
        self._loads: dict[str, int] = {}
        self._synced_this_step = False
        self.stats = RegistryECStats()
        self._first_seen: dict[str, float] = {}  # request_id -> when a step first considered it

    def ensure(self, request: "Request", num_computed_tokens: int) -> bool:
        features = request.mm_features
        self._first_seen.setdefault(request.request_id, time.monotonic())
        new = self.view.track(request.request_id, (f.identifier for f in features))
        if new or not self._synced_this_step:
            self.sync()
        needed = []
        for feature in features:
            self._num_tokens[feature.identifier] = feature.mm_position.get_num_embeds()
            if feature.mm_position.offset + feature.mm_position.length > num_computed_tokens:
                needed.append(feature.identifier)
        return self.view.ready(request.request_id, needed)

    def finish(self, request_id: str) -> None:
        self._first_seen.pop(request_id, None)
        for identifier in self.view.finish(request_id):
            self._num_tokens.pop(identifier, None)

    def after_alloc(self, request: "Request", index: int) -> None:
        identifier = request.mm_features[index].identifier
        if self.view.has(identifier):
            self._loads[identifier] = request.get_num_encoder_embeds(index)
            self.view.hand_over(identifier)
            self.stats.waited(time.monotonic() - self._first_seen.get(request.request_id, time.monotonic()))

    def build_meta(self, scheduler_output: "SchedulerOutput") -> RayRegistryECMetadata:
        loads = [ItemLoad(identifier, count) for identifier, count in self._loads.items()]
        loads += [ItemLoad(i, self._num_tokens[i], reload=True) for i in self.view.take_reloads() if i not in self._loads]
        loads += self._settled_elsewhere(scheduler_output, {load.identifier for load in loads})
        self._loads.clear()
        self._synced_this_step = False
        return RayRegistryECMetadata(tuple(loads))

    def _settled_elsewhere(self, scheduler_output: "SchedulerOutput", loading: set[str]) -> list[ItemLoad]:
        """Items of requests scheduled for the first time that the engine neither loads nor
        encodes: its encoder cache or prefix cache had them. Staged for this engine, they would
        wait for their ttl; the ranks acknowledge them instead. (Items of a prompt's later
        chunks that hit the engine's cache are not seen here and wait for their ttl.)"""
        settled = []
        for new in scheduler_output.scheduled_new_reqs:
            encoded_here = set(scheduler_output.scheduled_encoder_inputs.get(new.req_id, ()))
            covered = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            for index, feature in enumerate(new.mm_features or ()):
                identifier, position = feature.identifier, feature.mm_position
                if (
                    position.offset + position.length <= covered
                    and index not in encoded_here
                    and identifier not in loading
                    and self.view.state(identifier) == "staged"
                ):
                    settled.append(ItemLoad(identifier, position.get_num_embeds(), acknowledge_only=True))
                    loading.add(identifier)
                    self.view.hand_over(identifier)
        return settled

    def take_unavailable(self) -> set[str]:
        self.sync()
        for identifier, why in self.view.take_fallbacks().items():
            logger.warning("req_id=%s: %s; the engine encodes it itself", identifier, why)
        unavailable = self.view.take_unavailable()
        for request_id, why in unavailable.items():
            logger.warning("vLLM request %s fails: its encoder input is unavailable: %s", request_id, why)
        return set(unavailable)

    def sync(self) -> None:
        """Apply the watch's answer if it came, and keep one watch in flight. Never blocks."""
        import ray

        self._synced_this_step = True
        for shard, ref in list(self._watches.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                del self._watches[shard]
                self.view.asked(None, shard)
                try:
                    self.view.apply(ray.get(ref))
                except Exception as exc:  # noqa: BLE001 - the registry restarted or is gone: look again
                    logger.warning("registry watch failed (%s: %s); retrying", type(exc).__name__, exc)
                    self._finder.forget()
        known = self.view.to_watch()
        if not known:
            return
        shards = self._finder.shards()  # looked up on a thread of its own: never waited for here
        if shards is None:
            if self._finder.failed:
                # No registry to ask: what nobody could have encoded is computed by the engine.
                self.view.apply({identifier: "unknown" for identifier, state in known.items() if state is None})
            # Else a lookup is under way: the requests naming these items wait for it.
            return
        # One watch in flight per shard holding any of them, naming all of that shard's.
        for shard, identifiers in shards.group(known).items():
            if shard in self._watches:
                if not self.view.watch_is_stale(shard, identifiers):
                    continue
                ray.cancel(self._watches.pop(shard))  # it lacks identifiers added since: ask again
            subset = {identifier: known[identifier] for identifier in identifiers}
            self._watches[shard] = shards.handles[shard].watch.remote(subset, self.settings.watch_timeout_s)
            self.view.asked(subset, shard)
