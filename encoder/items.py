"""Request items (OpenAI-style) into media bytes, in the ingress, under a ``MediaPolicy``.

Accepted items::

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
    {"type": "image_url", "image_url": {"url": "https://cdn.example.com/cat.png"}}   # allowed_media_domains
    {"type": "image_url", "image_url": {"url": "file:///data/cat.png"}}              # allowed_local_media_path
    {"type": "image", "image": "<base64>"}

``data:`` URIs and bare base64 are decoded here; URLs and paths go through
``encoder.fetch.load_url``, which refuses anything the policy does not allow
(everything, by default). Every refusal is a ``MediaError`` saying what to fix.
This runs before anything is created, so a bad item stages nothing.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any, Mapping

from encoder.fetch import MediaPolicy, load_url
from encoder.media import MediaError

_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)


def _b64decode(text: str, what: str, max_item_bytes: int) -> bytes:
    # Refuse by length before decoding: base64 grows 4/3, so this bounds the memory too.
    if len(text) > (max_item_bytes + 2) // 3 * 4 + 4:
        raise MediaError(f"{what} decodes to more than the limit of {max_item_bytes} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{what} is not valid base64") from None


def item_bytes(item: Mapping[str, Any], policy: MediaPolicy) -> bytes:
    """The raw media bytes of one request item (blocking when it names a URL: run it in a thread)."""
    kind = item.get("type")
    if kind == "image":
        raw = item.get("image")
        if not isinstance(raw, str) or not raw:
            raise MediaError('an "image" item needs "image": a base64 string')
        data = _b64decode(raw, '"image"', policy.max_item_bytes)
    elif kind == "image_url":
        url_obj = item.get("image_url")
        url = url_obj.get("url") if isinstance(url_obj, Mapping) else None
        if not isinstance(url, str) or not url:
            raise MediaError('an "image_url" item needs "image_url": {"url": "..."}')
        if url[:5].lower() == "data:":
            match = _DATA_URI.match(url)
            if match is None or not match.group("b64"):
                raise MediaError('data: URIs must be base64 encoded ("data:image/png;base64,...")')
            data = _b64decode(url[match.end():], "the data: URI payload", policy.max_item_bytes)
        else:
            data = load_url(url, policy)
    else:
        raise MediaError(f'unsupported item type {kind!r}; use "image_url" or "image"')
    if not data:
        raise MediaError("the image is empty")
    if len(data) > policy.max_item_bytes:
        raise MediaError(f"the image is {len(data)} bytes; the limit is {policy.max_item_bytes} bytes")
    return data
