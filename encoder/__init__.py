"""Model loading, preprocessing and the forward pass. Imports no Ray."""

from encoder.base import VisionEncoder
from encoder.loader import FAMILIES, EncoderSpec, build_encoder, resolve_device
from encoder.fetch import MediaPolicy
from encoder.items import item_bytes
from encoder.media import MediaError
from encoder.types import DTYPES, EncodedItem, PreparedItem, payload_to_tensor, tensor_to_payload

__all__ = [
    "DTYPES",
    "FAMILIES",
    "EncodedItem",
    "EncoderSpec",
    "MediaError",
    "MediaPolicy",
    "PreparedItem",
    "VisionEncoder",
    "build_encoder",
    "item_bytes",
    "payload_to_tensor",
    "resolve_device",
    "tensor_to_payload",
]
