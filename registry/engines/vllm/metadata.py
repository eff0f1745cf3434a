"""What ``RayRegistryECConnector``'s two sides share: its settings (``ec_connector_extra_config``,
validated) and the metadata vLLM carries between them once per step (scheduler -> workers:
what to load; workers -> scheduler: what loaded and what failed). Both pickle: vLLM ships
them to its worker processes or Ray actors."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorWorkerMetadata

from registry.checks import check_rank, check_seconds
from registry.settings import registry_address

logger = logging.getLogger("vllm.ec_connector.ray_registry")


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """``ec_connector_extra_config``, validated (the keys: ``registry.vllm_connector``'s docstring)."""

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

    @property
    def registry_deadline_s(self) -> float:
        """How long the registry may stay silent before the scheduler treats it as down: a
        watch answers within ``watch_timeout_s``, so silence past that and a grace of as much
        again (at least 5 s, for a busy node) means it is stuck or gone."""
        return self.watch_timeout_s + max(self.watch_timeout_s, 5.0)


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
    """Scheduler -> workers, once per step: what to load."""

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
