"""Model loading, preprocessing and the forward pass. Imports no Ray."""

from encoder.base import VisionEncoder, content_hash, media_digest, mm_hash
from encoder.loader import FAMILIES, EncoderSpec, build_encoder, resolve_device
from encoder.fetch import MediaPolicy
from encoder.items import item_media
from encoder.media import MediaError
from encoder.types import DTYPES, EncodedItem, Media, PreparedItem, Video, payload_to_tensor, tensor_to_payload

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
