"""The staged-embedding registry, by side:

* ``registry.server``: the detached actor, its state machine and what only it uses;
* ``registry.client``: what decoder ranks import to receive (never the server, never Serve);
* ``registry.engines``: adapters for serving engines (vLLM's connector, public as
  ``registry.vllm_connector``);
* here, the core every side shares: ``errors``, ``settings``, ``states``, ``routing``
  (``shard_of``), ``logs`` and ``supervision``.

Names below load on first use, so ``registry.client.zmq_receiver`` and ``registry.errors``
can be imported in a process without Ray (a decoder rank outside the cluster).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "RegistryError": "registry.errors",
    "MediaInput": "registry.server.inputs",
    "media_input": "registry.server.inputs",
    "get_or_create_registry": "registry.server.create",
    "get_or_create_shards": "registry.server.create",
    "lookup_registry": "registry.client.shards",
    "lookup_shards": "registry.client.shards",
    "EmbeddingReceiver": "registry.client.receiver",
    "ReceivedItem": "registry.client.received_item",
    "Shards": "registry.client.shards",
    "shard_of": "registry.routing",
    "DEFAULT_REGISTRY_NAME": "registry.settings",
    "DEFAULT_REGISTRY_NAMESPACE": "registry.settings",
    "RegistrySettings": "registry.settings",
    "Limits": "registry.settings",
    "RegistryState": "registry.server.state",
    "ZmqEmbeddingReceiver": "registry.client.zmq_receiver",
}

__all__ = sorted([*_EXPORTS, "errors"])

if TYPE_CHECKING:
    from registry import errors
    from registry.errors import RegistryError
    from registry.server.inputs import MediaInput, media_input
    from registry.client.shards import lookup_registry, lookup_shards
    from registry.server.create import get_or_create_registry, get_or_create_shards
    from registry.client.received_item import ReceivedItem
    from registry.client.receiver import EmbeddingReceiver
    from registry.settings import DEFAULT_REGISTRY_NAME, DEFAULT_REGISTRY_NAMESPACE, RegistrySettings
    from registry.client.shards import Shards
    from registry.routing import shard_of
    from registry.server.state import RegistryState
    from registry.settings import Limits
    from registry.client.zmq_receiver import ZmqEmbeddingReceiver


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module("registry.errors")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'registry' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value
