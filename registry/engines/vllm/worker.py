"""The worker side of ``registry.vllm_connector.RayRegistryECConnector``: one per TP worker.

``load`` runs in ``start_load_caches``: it fetches each item the scheduler listed as this
worker's TP rank, with one registry call per shard for the whole step, and puts the tensor
in vLLM's ``encoder_cache`` on the worker's device in the model's dtype. An item the cache
holds already is acknowledged instead (one call per shard too), so the registry counts the
rank without the bytes being read again. A failed load never raises; see the connector's
docstring.

Connecting to Ray and finding the registry take seconds on a busy node (a vLLM ``mp``
worker is a process without Ray). They start on a thread when the worker is built, while
the engine loads; a step that loads before they finished waits for them, within
``fetch_timeout_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from registry.engines.vllm.metadata import ConnectorSettings, ItemLoad

# The connector's logger: one name for both of its sides.
logger = logging.getLogger("vllm.ec_connector.ray_registry")


class WorkerSide:
    def __init__(self, vllm_config: "VllmConfig", settings: ConnectorSettings):
        self.settings = settings
        model = vllm_config.model_config
        self._dtype = model.dtype if model is not None else None
        widths = vllm_config.ec_transfer_config.mm_encoder_output_widths
        self._width = widths.get("image") or _image_width(model)
        self._receivers: dict[int, Any] = {}
        self._loaded: set[str] = set()
        self._failed: dict[str, str] = {}
        self._load_s = 0.0  # since the last report: the fetches' and placements' time
        self._shards: Any = None  # the registry's shards, once found
        self._waited_for_connect = False
        self._connecting = threading.Thread(target=self._connect, name="epd-registry-connect", daemon=True)
        self._connecting.start()

    def load(self, loads: tuple[ItemLoad, ...], encoder_cache: dict[str, torch.Tensor]) -> None:
        rank = _tp_rank(self.settings.tp_rank)
        if rank is None or not loads:
            return  # a later pipeline stage: it never reads multimodal embeddings
        device = _device()
        to_fetch, to_acknowledge = [], []
        for load in loads:
            if load.acknowledge_only or (load.identifier in encoder_cache and not load.reload):
                to_acknowledge.append(load.identifier)
            else:
                to_fetch.append(load)
        started = time.monotonic()
        try:
            receiver = self._receiver(rank)
        except Exception as exc:  # noqa: BLE001 - a failed load must not take the worker down
            receiver, fetched = None, dict.fromkeys((load.identifier for load in to_fetch), exc)
            if to_acknowledge:
                logger.info("rank=%d: acknowledging cached items %s failed: %s", rank, to_acknowledge, exc)
        if receiver is not None:
            if to_acknowledge:
                self._acknowledge(receiver, to_acknowledge)
            if not to_fetch:
                return
            # One registry call per shard for the whole step, not one per item.
            try:
                fetched = receiver.fetch_many([load.identifier for load in to_fetch], timeout_s=self.settings.fetch_timeout_s)
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
        self._load_s += time.monotonic() - started

    def take_report(self) -> tuple[frozenset[str], dict[str, str], float] | None:
        """What this step loaded, what failed (-> why), and the seconds the fetches took,
        since the last report."""
        if not self._loaded and not self._failed:
            return None
        report = frozenset(self._loaded), dict(self._failed), self._load_s
        self._loaded.clear()
        self._failed.clear()
        self._load_s = 0.0
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

    def _acknowledge(self, receiver: Any, identifiers: list[str]) -> None:
        """Count this rank for items it holds already: one registry call per shard."""
        from registry.errors import AlreadyReleased, RegistryError

        try:
            answers = receiver.acknowledge_many(identifiers)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the rank holds the items: only tell
            answers = dict.fromkeys(identifiers, exc)
        for identifier, answer in answers.items():
            # The rank holds the item: nothing to fail, only to tell.
            if isinstance(answer, BaseException) and not isinstance(answer, AlreadyReleased):
                code = answer.code if isinstance(answer, RegistryError) else type(answer).__name__
                logger.info("req_id=%s rank=%d: acknowledging a cached item failed: [%s] %s", identifier, receiver.rank, code, answer)

    def _connect(self) -> None:
        """Join the cluster and find the registry (on the connecting thread, or again in a
        step after that failed); sets ``self._shards``, raises what failed."""
        import ray

        from registry.client.shards import Shards
        from registry.engines.vllm.finder import cluster_address

        try:
            if not ray.is_initialized():
                # As the scheduler side does: a worker process of vLLM's ``mp`` backend has no Ray
                # of its own, and Ray's automatic init would start a new local cluster (no registry).
                ray.init(address=cluster_address(self.settings.ray_address), log_to_driver=False)
            self._shards = Shards.lookup(
                self.settings.registry_name, self.settings.registry_namespace, timeout_s=self.settings.fetch_timeout_s
            )
        except Exception as exc:  # noqa: BLE001 - a step that loads tries again and reports it
            if threading.current_thread() is self._connecting:
                logger.info("connecting to the registry failed (%s: %s); the first load tries again", type(exc).__name__, exc)
                return
            raise

    def _receiver(self, rank: int) -> Any:
        """This rank's receiver; raises if the cluster or the registry cannot be reached."""
        if rank not in self._receivers:
            from registry.client.receiver import EmbeddingReceiver

            # Waited for once, as long as a fetch may take; later loads fail at once while it hangs.
            self._connecting.join(0 if self._waited_for_connect else self.settings.fetch_timeout_s)
            self._waited_for_connect = True
            if self._connecting.is_alive():
                raise TimeoutError(f"connecting to the registry has taken over {self.settings.fetch_timeout_s:g} s "
                                   "(fetch_timeout_s); is ray_address the cluster's?")
            if self._shards is None:
                self._connect()
            self._receivers[rank] = EmbeddingReceiver(
                rank, registry_name=self.settings.registry_name, registry_namespace=self.settings.registry_namespace,
                shards=self._shards,
            )
        return self._receivers[rank]


def _image_width(model: Any) -> int:
    """An image's width in the encoder cache (a consumer measures none): the language model's
    input width, and for a DeepStack model (Qwen3-VL) ``out_hidden_size`` per level more. The
    zero placeholder of a failed load needs it: that model splits the entry on the last axis,
    and a narrower one fails the whole step, every request in it."""
    if model is None:
        return 0
    vision = getattr(model.hf_config, "vision_config", None)
    levels = len(getattr(vision, "deepstack_visual_indexes", None) or ())
    return vision.out_hidden_size * (1 + levels) if levels else model.get_inputs_embeds_size()


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
