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
* ``ray_address``: where a process without Ray connects (default ``"auto"``).

Scheduler side (one per engine, in the scheduler's process)
    Never calls the registry per question: ``ensure_cache_available`` and
    ``has_cache_item`` read a local ``registry.engine_view.EngineView`` that one
    long-poll ``watch`` call in flight keeps current (checked without blocking,
    at most once per new request and once per step). ``ensure_cache_available``
    defers a request while any item it still needs is pending or not yet heard
    of; ``has_cache_item`` is True while the item is pending or staged;
    ``update_state_after_alloc`` and ``build_connector_meta`` hand the workers the
    identifiers to load with their token counts, and the items a newly scheduled
    request got from the engine's own encoder or prefix cache, for the ranks to
    acknowledge (staged for this engine, they would otherwise wait for their
    ttl); ``take_unavailable_requests``
    returns the requests whose items ended failed, expired, cancelled or lost, or
    that a worker could not load.

Worker side (one per TP worker)
    ``start_load_caches`` fetches each listed identifier as this worker's TP
    rank and puts the tensor in ``encoder_cache`` on the worker's device in the
    model's dtype. An identifier already cached counts as this rank's receipt (an
    acknowledgement that reads no bytes). Only the first pipeline stage loads. A
    failed fetch never raises: the worker logs one line, leaves a zero
    placeholder so the step runs, and reports the identifier back, and the
    scheduler fails the request.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from registry.engine_view import EngineView
from registry.settings import MAX_WAIT_S, registry_address

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

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        name, namespace = registry_address(extra.pop("registry_name", None), extra.pop("registry_namespace", None))
        settings = cls(name, namespace, **{k: extra.pop(k) for k in ("tp_rank", "fetch_timeout_s", "watch_timeout_s", "ray_address") if k in extra})
        if extra:
            logger.warning("ec_connector_extra_config keys %s are not RayRegistryECConnector's; ignored", sorted(extra))
        if isinstance(settings.tp_rank, bool) or not isinstance(settings.tp_rank, int) or settings.tp_rank < 0:
            raise ValueError(f"ec_connector_extra_config.tp_rank must be an integer >= 0, got {settings.tp_rank!r}")
        for key in ("fetch_timeout_s", "watch_timeout_s"):
            value = getattr(settings, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_WAIT_S or math.isnan(value):
                raise ValueError(f"ec_connector_extra_config.{key} must be seconds in (0, {MAX_WAIT_S:.0f}], got {value!r}")
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

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        if not isinstance(other, RayRegistryECWorkerMetadata):
            return self
        return RayRegistryECWorkerMetadata(self.loaded | other.loaded, {**self.failed, **other.failed})


class RayRegistryECConnector(ECConnectorBase):
    def __init__(self, vllm_config: "VllmConfig", role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        settings = ConnectorSettings.from_extra_config(vllm_config.ec_transfer_config.ec_connector_extra_config)
        self._scheduler = _SchedulerSide(settings) if role == ECConnectorRole.SCHEDULER else None
        self._worker = _WorkerSide(vllm_config, settings) if role == ECConnectorRole.WORKER else None

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
        return self._worker.take_report() if self._worker is not None else None

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

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.view.finish(request.request_id)
        return False, None


class _SchedulerSide:
    def __init__(self, settings: ConnectorSettings):
        self.settings = settings
        self.view = EngineView()
        self._shards: Any = None  # registry.shards.Shards, once found
        self._next_lookup = 0.0
        self._watches: dict[int, Any] = {}  # registry shard -> the ObjectRef of its watch call in flight
        self._num_tokens: dict[str, int] = {}
        self._loads: dict[str, int] = {}
        self._synced_this_step = False

    def ensure(self, request: "Request", num_computed_tokens: int) -> bool:
        features = request.mm_features
        new = self.view.track(request.request_id, (f.identifier for f in features))
        if new or not self._synced_this_step:
            self.sync()
        needed = []
        for feature in features:
            self._num_tokens[feature.identifier] = feature.mm_position.get_num_embeds()
            if feature.mm_position.offset + feature.mm_position.length > num_computed_tokens:
                needed.append(feature.identifier)
        return self.view.ready(request.request_id, needed)

    def after_alloc(self, request: "Request", index: int) -> None:
        identifier = request.mm_features[index].identifier
        if self.view.has(identifier):
            self._loads[identifier] = request.get_num_encoder_embeds(index)
            self.view.hand_over(identifier)

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
                    self._shards = None
        known = self.view.to_watch()
        if not known:
            return
        shards = self._lookup()
        if shards is None:
            # No registry to ask: what nobody could have encoded is computed by the engine.
            self.view.apply({identifier: "unknown" for identifier, state in known.items() if state is None})
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

    def _lookup(self) -> Any:
        if self._shards is not None or time.monotonic() < self._next_lookup:
            return self._shards
        import ray

        from registry.errors import Unavailable
        from registry.shards import Shards

        self._next_lookup = time.monotonic() + _LOOKUP_RETRY_S
        try:
            if not ray.is_initialized():
                ray.init(address=self.settings.ray_address)
            self._shards = Shards.lookup(self.settings.registry_name, self.settings.registry_namespace)
        except (Unavailable, ConnectionError) as exc:
            logger.warning("RayRegistryECConnector: %s; items are computed by the engine until it is found", exc)
        return self._shards


class _WorkerSide:
    def __init__(self, vllm_config: "VllmConfig", settings: ConnectorSettings):
        self.settings = settings
        model = vllm_config.model_config
        self._dtype = model.dtype if model is not None else None
        widths = vllm_config.ec_transfer_config.mm_encoder_output_widths
        self._width = widths.get("image") or (model.get_inputs_embeds_size() if model is not None else 0)
        self._receivers: dict[int, Any] = {}
        self._loaded: set[str] = set()
        self._failed: dict[str, str] = {}

    def load(self, loads: tuple[ItemLoad, ...], encoder_cache: dict[str, torch.Tensor]) -> None:
        rank = _tp_rank(self.settings.tp_rank)
        if rank is None or not loads:
            return  # a later pipeline stage: it never reads multimodal embeddings
        receiver = self._receiver(rank)
        device = _device()
        to_fetch = []
        for load in loads:
            if load.acknowledge_only or (load.identifier in encoder_cache and not load.reload):
                self._acknowledge(receiver, load.identifier)
            else:
                to_fetch.append(load)
        if not to_fetch:
            return
        # One registry call per shard for the whole step, not one per item.
        try:
            fetched: dict[str, Any] = receiver.fetch_many(
                [load.identifier for load in to_fetch], timeout_s=self.settings.fetch_timeout_s
            )
        except Exception as exc:  # noqa: BLE001 - a failed load must not take the worker down
            fetched = dict.fromkeys((load.identifier for load in to_fetch), exc)
        for load in to_fetch:
            try:
                encoder_cache[load.identifier] = self._checked(load, fetched[load.identifier]).to(device=device, dtype=self._dtype)
                self._loaded.add(load.identifier)
            except Exception as exc:  # noqa: BLE001 - a failed load must not take the worker down
                why = f"[{getattr(exc, 'code', type(exc).__name__)}] {exc}"
                logger.warning("req_id=%s rank=%d: loading the staged embedding failed: %s", load.identifier, rank, why)
                self._failed[load.identifier] = why
                dtype = self._dtype or torch.float32
                encoder_cache[load.identifier] = torch.zeros(load.num_tokens, self._width, dtype=dtype, device=device)

    def take_report(self) -> RayRegistryECWorkerMetadata | None:
        if not self._loaded and not self._failed:
            return None
        report = RayRegistryECWorkerMetadata(frozenset(self._loaded), dict(self._failed))
        self._loaded.clear()
        self._failed.clear()
        return report

    def _checked(self, load: ItemLoad, items: Any) -> torch.Tensor:
        """The item's tensor from a ``fetch_many`` answer; raises its error or a mismatch."""
        from registry.errors import InvalidRequest

        if isinstance(items, BaseException):
            raise items
        if len(items) != 1:
            raise InvalidRequest(f"req_id {load.identifier} holds {len(items)} items; an engine item is a one-item encode")
        tensor = items[0].tensor
        if tensor.ndim != 2 or tensor.shape[0] != load.num_tokens:
            raise InvalidRequest(
                f"req_id {load.identifier} is an embedding of shape {list(tensor.shape)}; the engine expects "
                f"{load.num_tokens} tokens: the encoder serves another model or preprocessing than the engine"
            )
        return tensor

    def _acknowledge(self, receiver: Any, identifier: str) -> None:
        from registry.errors import AlreadyReleased, RegistryError

        try:
            receiver.acknowledge(identifier)
        except AlreadyReleased:
            pass
        except RegistryError as exc:  # the rank holds the item: nothing to fail, only to tell
            logger.info("req_id=%s rank=%d: acknowledging a cached item failed: [%s] %s", identifier, receiver.rank, exc.code, exc)

    def _receiver(self, rank: int) -> Any:
        if rank not in self._receivers:
            from registry.receiver import EmbeddingReceiver

            self._receivers[rank] = EmbeddingReceiver(
                rank, registry_name=self.settings.registry_name, registry_namespace=self.settings.registry_namespace
            )
        return self._receivers[rank]


def _tp_rank(default: int) -> int | None:
    """This worker's TP rank, or None on a pipeline stage after the first."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return default
    if not parallel_state.get_pp_group().is_first_rank:
        return None
    return parallel_state.get_tensor_model_parallel_rank()


def _device() -> torch.device:
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return torch.device(current_platform.device_type, current_platform.current_device())
    return torch.device(current_platform.device_type or ("cuda" if torch.cuda.is_available() else "cpu"))
