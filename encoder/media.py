"""Image bytes into pixels, safely, and the error every media problem raises.

``open_image`` runs in the encoder replica: it reads the image header, checks
the pixel count *before* decoding (decompression bombs), then decodes, turns the
image upright by its EXIF orientation and composites any transparency onto white,
as vLLM and transformers do.
(Request items become bytes earlier, in the ingress: ``encoder.items``.)

Every failure raises ``MediaError`` with a message that says what to fix; the
serving layer maps it to the ``invalid_request`` code.
"""

from __future__ import annotations

import contextlib
import io

from PIL import Image, ImageOps, UnidentifiedImageError

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


class MediaError(ValueError):
    """A request item that cannot be turned into an image; the message says why."""


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
    # Turned upright as its EXIF orientation says, as vLLM (and transformers' load_image)
    # do: a camera photo would otherwise embed sideways here and upright in the engine.
    with contextlib.suppress(Exception):  # a malformed EXIF block leaves the image as stored
        image = ImageOps.exif_transpose(image)
    return _to_rgb(image)


def media_type(data: bytes) -> str:
    """The MIME type of image file bytes, from the header alone (``image/png``, ``image/jpeg``,
    ...); ``application/octet-stream`` for bytes that are no image PIL recognizes. Decodes
    no pixels: cheap for any size."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return Image.MIME.get(image.format or "", "application/octet-stream")
    except Exception:  # noqa: BLE001 - not an image (the encode says why): no type to name
        return "application/octet-stream"


def _to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as RGB, with any transparency composited onto white."""
    # As transformers' convert_to_rgb and vLLM's convert_image_mode do: convert("RGB")
    # alone keeps the colour under transparent pixels, so the same file would embed
    # differently here than in the reference processors. The test is transformers':
    # an alpha band, or a "transparency" entry (tRNS in P, L, RGB and 1 images).
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image).convert("RGB")
    return image.convert("RGB")
