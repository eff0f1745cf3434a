"""Registry settings, and the environment variables of the service's own settings.

Decoder ranks find the registry by name and namespace. The defaults below are
the ones ``serve_config.yaml`` ships with; ``EPD_REGISTRY_NAME`` and
``EPD_REGISTRY_NAMESPACE`` override them for receivers in processes that do not
see the app config. ``EPD_API_TOKEN`` is the HTTP API's bearer token when the
app config does not set ``api_token`` (a secret belongs in the environment).
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Limits:
    """The lifecycle's limits, named as ``deployments.AppConfig``'s keys, which hold every
    default and description (``AppConfig.limits()`` builds this)."""

    ttl_s: float
    encode_timeout_s: float
    max_receive_count: int
    tombstone_ttl_s: float
    max_tombstones: int
    # Admission: past either, a new request is refused with ``overloaded``.
    max_pending_requests: int
    max_staged_bytes: int
    # An HTTP pull counts its rank this long after the rank's last pull (or at its acknowledgement).
    http_pull_grace_s: float = 10.0
    # Bytes of media the pending requests hold; past it, a new request gets ``overloaded``.
    max_pending_input_bytes: int = 2 * 1024**3


DEFAULT_REGISTRY_NAME = "epd_registry"
DEFAULT_REGISTRY_NAMESPACE = "epd"
ENV_REGISTRY_NAME = "EPD_REGISTRY_NAME"
ENV_REGISTRY_NAMESPACE = "EPD_REGISTRY_NAMESPACE"
ENV_API_TOKEN = "EPD_API_TOKEN"
# The longest any call may wait (a fetch's timeout_s, a describe's wait_s), in seconds.
MAX_WAIT_S = 3600.0


def api_token_from_env() -> str | None:
    return os.environ.get(ENV_API_TOKEN) or None


def registry_address(name: str | None = None, namespace: str | None = None) -> tuple[str, str]:
    """(name, namespace) of the registry: explicit arguments, else env, else defaults."""
    return (
        name or os.environ.get(ENV_REGISTRY_NAME) or DEFAULT_REGISTRY_NAME,
        namespace or os.environ.get(ENV_REGISTRY_NAMESPACE) or DEFAULT_REGISTRY_NAMESPACE,
    )


@dataclasses.dataclass(frozen=True)
class RegistrySettings:
    """Everything the registry actor needs, named as ``deployments.AppConfig``'s keys, which
    hold every default and description (``AppConfig.registry_settings()`` builds this)."""

    name: str
    namespace: str
    limits: Limits
    default_receive_count: int
    # Each waiting fetch holds one actor call slot; fixed when the actor is created.
    registry_max_concurrency: int
    # Bytes of embeddings the content-hash cache keeps for reuse; 0 turns it off.
    cache_max_bytes: int
    # Staged bytes are also capped at this share of the cluster's object store.
    max_object_store_fraction: float
    # Where the registry sends encode work: a Serve deployment, by app and name.
    encoder_app: str
    encoder_deployment: str = "Encoder"
    # Most items in one Encoder call (``registry.server.batched_calls``).
    encoder_call_max_items: int = 8
    # How many registry actors share the req_ids (``registry.client.shards``), and which one this
    # is; fixed when the actors are created.
    registry_shards: int = 1
    shard: int = 0
    # After a restart, how long a fetch of an unknown req_id waits (for a new request
    # to arrive) before it is answered `unavailable`: its entry was lost.
    restart_grace_s: float = 5.0
    # The actor's CPU niceness (``registry.server.priority``); None keeps Ray's (15).
    niceness: int | None = 0

    def for_shard(self, shard: int) -> RegistrySettings:
        """Shard ``shard``'s settings: the app-wide limits split evenly among the shards
        (rounded up), since each admits and remembers only its own req_ids."""
        n = self.registry_shards

        def share(total: int) -> int:
            return -(-total // n)

        limits = dataclasses.replace(
            self.limits,
            max_pending_requests=share(self.limits.max_pending_requests),
            max_staged_bytes=share(self.limits.max_staged_bytes),
            max_pending_input_bytes=share(self.limits.max_pending_input_bytes),
            max_tombstones=share(self.limits.max_tombstones),
        )
        return dataclasses.replace(self, shard=shard, limits=limits, cache_max_bytes=share(self.cache_max_bytes),
                                   max_object_store_fraction=self.max_object_store_fraction / n)
