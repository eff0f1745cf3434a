"""Request items (OpenAI-style) into media, in the ingress, under a ``MediaPolicy``.

Accepted items::

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
    {"type": "image_url", "image_url": {"url": "https://cdn.example.com/cat.png"}}   # allowed_media_domains
    {"type": "image_url", "image_url": {"url": "file:///data/cat.png"}}              # allowed_local_media_path
    {"type": "image", "image": "<base64>"}
    {"type": "video", "video": ["data:image/jpeg;base64,...", ...]}   # frames, each like an image_url's url

``data:`` URIs and bare base64 are decoded here; URLs and paths go through
``encoder.media_fetch.load_url``, which refuses anything the policy does not allow
(everything, by default). Every refusal is a ``MediaError`` saying what to fix.
This runs before anything is created, so a bad item stages nothing.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any, Mapping

from encoder.media_fetch import MediaPolicy, load_url
from encoder.media import MediaError
from encoder.types import Media, Video

_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)


def _b64decode(text: str, what: str, max_item_bytes: int) -> bytes:
    # Refuse by length before decoding: base64 grows 4/3, so this bounds the memory too.
    if len(text) > (max_item_bytes + 2) // 3 * 4 + 4:
        raise MediaError(f"{what} decodes to more than the limit of {max_item_bytes} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{what} is not valid base64") from None


def _url_bytes(url: str, policy: MediaPolicy) -> bytes:
    if url[:5].lower() == "data:":
        match = _DATA_URI.match(url)
        if match is None or not match.group("b64"):
            raise MediaError('data: URIs must be base64 encoded ("data:image/png;base64,...")')
        return _b64decode(url[match.end():], "the data: URI payload", policy.max_item_bytes)
    return load_url(url, policy)


def _checked(data: bytes, policy: MediaPolicy, what: str = "the image") -> bytes:
    if not data:
        raise MediaError(f"{what} is empty")
    if len(data) > policy.max_item_bytes:
        raise MediaError(f"{what} is {len(data)} bytes; the limit is {policy.max_item_bytes} bytes")
    return data


def item_media(item: Mapping[str, Any], policy: MediaPolicy, max_video_frames: int = 64) -> Media:
    """The media of one request item: image bytes, or a ``Video`` of frame bytes.

    Blocking when it names URLs or paths: run it in a thread.
    """
    kind = item.get("type")
    if kind == "image":
        raw = item.get("image")
        if not isinstance(raw, str) or not raw:
            raise MediaError('an "image" item needs "image": a base64 string')
        return _checked(_b64decode(raw, '"image"', policy.max_item_bytes), policy)
    if kind == "image_url":
        url_obj = item.get("image_url")
        url = url_obj.get("url") if isinstance(url_obj, Mapping) else None
        if not isinstance(url, str) or not url:
            raise MediaError('an "image_url" item needs "image_url": {"url": "..."}')
        return _checked(_url_bytes(url, policy), policy)
    if kind == "video":
        frames = item.get("video")
        if not isinstance(frames, list) or not frames or not all(isinstance(f, str) and f for f in frames):
            raise MediaError('a "video" item needs "video": a non-empty list of frame URLs')
        if len(frames) > max_video_frames:
            raise MediaError(f"the video has {len(frames)} frames; the limit is {max_video_frames} (max_video_frames)")
        return Video(tuple(_checked(_url_bytes(f, policy), policy, f"frame {i}") for i, f in enumerate(frames)))
    raise MediaError(f'unsupported item type {kind!r}; use "image_url", "image" or "video"')
