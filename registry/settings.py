"""Registry settings, and the one place the project reads environment variables.

Decoder ranks find the registry by name and namespace. The defaults below are
the ones ``serve_config.yaml`` ships with; ``EPD_REGISTRY_NAME`` and
``EPD_REGISTRY_NAMESPACE`` override them for receivers in processes that do not
see the app config. ``EPD_API_TOKEN`` is the HTTP API's bearer token when the
app config does not set ``api_token`` (a secret belongs in the environment).
"""

from __future__ import annotations

import dataclasses
import os

from registry.state import Limits

DEFAULT_REGISTRY_NAME = "epd_registry"
DEFAULT_REGISTRY_NAMESPACE = "epd"
ENV_REGISTRY_NAME = "EPD_REGISTRY_NAME"
ENV_REGISTRY_NAMESPACE = "EPD_REGISTRY_NAMESPACE"
ENV_API_TOKEN = "EPD_API_TOKEN"


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
    """Everything the registry actor needs. Built by the app from its config."""

    name: str = DEFAULT_REGISTRY_NAME
    namespace: str = DEFAULT_REGISTRY_NAMESPACE
    limits: Limits = Limits()
    default_receive_count: int = 1
    # Where the registry sends encode work: a Serve deployment, by app and name.
    encoder_app: str = "epd"
    encoder_deployment: str = "Encoder"
    # Each waiting fetch holds one actor call slot; size for ranks x requests in flight.
    max_concurrency: int = 10_000
    # Bytes of embeddings the content-hash cache keeps for reuse; 0 turns it off.
    cache_max_bytes: int = 512 * 1024 * 1024
    # Staged bytes are also capped at this share of the cluster's object store.
    object_store_fraction: float = 0.5
    # After a restart, how long a fetch of an unknown req_id waits (for a new request
    # to arrive) before it is answered `unavailable`: its entry was lost.
    restart_grace_s: float = 5.0
