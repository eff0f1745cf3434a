"""Turning request items into image bytes, and image bytes into pixels, safely.

Two steps, kept apart because they run in different places:

* ``item_bytes`` runs in the HTTP ingress: it only unwraps the request item
  (``data:`` URI or bare base64) into raw bytes and enforces the size limit, so
  a malformed request is refused before anything is created.
* ``open_image`` runs in the encoder replica: it reads the image header, checks
  the pixel count *before* decoding (decompression bombs), then decodes.

Every failure raises ``MediaError`` with a message that says what to fix; the
serving layer maps it to the ``invalid_request`` code.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any, Mapping

from PIL import Image, UnidentifiedImageError

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")

_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)


class MediaError(ValueError):
    """A request item that cannot be turned into an image; the message says why."""


def _b64decode(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{what} is not valid base64") from None


def item_bytes(item: Mapping[str, Any], max_bytes: int) -> bytes:
    """The raw media bytes of one request item.

    Accepted shapes (OpenAI-compatible):
    ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` and
    ``{"type": "image", "image": "<base64>"}``.
    """
    kind = item.get("type")
    if kind == "image":
        raw = item.get("image")
        if not isinstance(raw, str) or not raw:
            raise MediaError('an "image" item needs "image": a base64 string')
        data = _b64decode(raw, '"image"')
    elif kind == "image_url":
        url_obj = item.get("image_url")
        url = url_obj.get("url") if isinstance(url_obj, Mapping) else None
        if not isinstance(url, str) or not url:
            raise MediaError('an "image_url" item needs "image_url": {"url": "data:..."}')
        match = _DATA_URI.match(url)
        if match is None:
            scheme = url.split(":", 1)[0] if ":" in url else "a local path"
            raise MediaError(
                f"image_url scheme {scheme!r} is not enabled; send the image inline as "
                '"data:image/<format>;base64,<bytes>"'
            )
        if not match.group("b64"):
            raise MediaError('data: URIs must be base64 encoded ("data:image/png;base64,...")')
        data = _b64decode(url[match.end():], "the data: URI payload")
    else:
        raise MediaError(f'unsupported item type {kind!r}; use "image_url" or "image"')
    if not data:
        raise MediaError("the image is empty")
    if len(data) > max_bytes:
        raise MediaError(f"the image is {len(data)} bytes; the limit is {max_bytes} bytes")
    return data


def open_image(data: bytes, *, max_pixels: int, min_side: int) -> Image.Image:
    """Decode ``data`` into an RGB image, refusing bombs, tiny images and odd formats."""
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise MediaError(
            f"the bytes are not an image in a supported format ({', '.join(SUPPORTED_FORMATS)})"
        ) from None
    except Image.DecompressionBombError:
        raise MediaError(f"the image has more pixels than the limit of {max_pixels}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(f"the image header is corrupt ({exc.__class__.__name__})") from None
    if image.format not in SUPPORTED_FORMATS:
        raise MediaError(f"image format {image.format} is not supported; use one of {', '.join(SUPPORTED_FORMATS)}")
    width, height = image.size
    # The header is read; the pixels are not. Checking here keeps a 100k x 100k
    # PNG of a few KB from allocating gigabytes.
    if width * height > max_pixels:
        raise MediaError(f"the image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}")
    if min(width, height) < min_side:
        raise MediaError(f"the image is {width}x{height}; each side must be at least {min_side} pixels")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"the image data is corrupt or truncated ({exc.__class__.__name__})") from None
    return image.convert("RGB")
