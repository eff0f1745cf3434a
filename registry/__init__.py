"""The staged-embedding registry: its actor, state machine, errors and the decoder-side receiver."""

from registry import errors
from registry.errors import RegistryError
from registry.inputs import MediaInput, media_input
from registry.lookup import get_or_create_registry, get_or_create_shards, lookup_registry, lookup_shards
from registry.receiver import EmbeddingReceiver, ReceivedItem
from registry.shards import Shards, shard_of
from registry.settings import DEFAULT_REGISTRY_NAME, DEFAULT_REGISTRY_NAMESPACE, RegistrySettings
from registry.state import Limits, RegistryState

__all__ = [
    "DEFAULT_REGISTRY_NAME",
    "DEFAULT_REGISTRY_NAMESPACE",
    "EmbeddingReceiver",
    "Limits",
    "MediaInput",
    "ReceivedItem",
    "RegistryError",
    "RegistrySettings",
    "RegistryState",
    "Shards",
    "errors",
    "get_or_create_registry",
    "get_or_create_shards",
    "lookup_registry",
    "lookup_shards",
    "media_input",
    "shard_of",
]
