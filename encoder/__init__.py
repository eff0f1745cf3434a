"""The encoder side: request items to bytes (media policy, fetching), image decoding,
content hashes, and the vision towers (loading, preprocessing, the forward pass). Imports no Ray.

Importing the package does not import torch: the ingress and the registry use
its media, hashing and spec parts, and torch would cost each of their processes
seconds to start and hundreds of MB. The model parts load on first use.
"""

import importlib
from typing import Any

from encoder.media_fetch import MediaPolicy
from encoder.hashing import content_hash, media_digest, mm_hash
from encoder.items import item_media
from encoder.media import MediaError
from encoder.spec import FAMILIES, EncoderSpec
from encoder.types import DTYPES, EncodedItem, Media, PreparedItem, Video, payload_to_tensor, tensor_to_payload

# Names whose modules import torch, and the module each comes from.
_WITH_TORCH = {"VisionEncoder": "encoder.base", "build_encoder": "encoder.loader", "resolve_device": "encoder.loader"}


def __getattr__(name: str) -> Any:
    if name not in _WITH_TORCH:
        raise AttributeError(f"module 'encoder' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_WITH_TORCH[name]), name)
    return value


__all__ = [
    "DTYPES",
    "FAMILIES",
    "EncodedItem",
    "EncoderSpec",
    "MediaError",
    "Media",
    "MediaPolicy",
    "PreparedItem",
    "Video",
    "VisionEncoder",
    "build_encoder",
    "content_hash",
    "item_media",
    "media_digest",
    "mm_hash",
    "payload_to_tensor",
    "resolve_device",
    "tensor_to_payload",
]
