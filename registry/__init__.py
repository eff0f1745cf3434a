"""The staged-embedding registry: its actor, state machine, errors and the decoder-side receivers.

Names load on first use, so ``registry.zmq_receiver`` and ``registry.errors`` can
be imported in a process without Ray (a decoder rank outside the cluster).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "RegistryError": "registry.errors",
    "MediaInput": "registry.inputs",
    "media_input": "registry.inputs",
    "get_or_create_registry": "registry.lookup",
    "get_or_create_shards": "registry.lookup",
    "lookup_registry": "registry.lookup",
    "lookup_shards": "registry.lookup",
    "EmbeddingReceiver": "registry.receiver",
    "ReceivedItem": "registry.received",
    "Shards": "registry.shards",
    "shard_of": "registry.shards",
    "DEFAULT_REGISTRY_NAME": "registry.settings",
    "DEFAULT_REGISTRY_NAMESPACE": "registry.settings",
    "RegistrySettings": "registry.settings",
    "Limits": "registry.state",
    "RegistryState": "registry.state",
    "ZmqEmbeddingReceiver": "registry.zmq_receiver",
}

__all__ = sorted([*_EXPORTS, "errors"])

if TYPE_CHECKING:
    from registry import errors
    from registry.errors import RegistryError
    from registry.inputs import MediaInput, media_input
    from registry.lookup import get_or_create_registry, get_or_create_shards, lookup_registry, lookup_shards
    from registry.received import ReceivedItem
    from registry.receiver import EmbeddingReceiver
    from registry.settings import DEFAULT_REGISTRY_NAME, DEFAULT_REGISTRY_NAMESPACE, RegistrySettings
    from registry.shards import Shards, shard_of
    from registry.state import Limits, RegistryState
    from registry.zmq_receiver import ZmqEmbeddingReceiver


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module("registry.errors")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'registry' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value
