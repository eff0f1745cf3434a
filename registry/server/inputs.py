"""``MediaInput``: how an item's bytes reach the registry, which passes them on unread.

The registry never looks inside the media: it needs the item's digest (for the
``mm_hash`` under which embeddings are cached and shared) and something to hand
to the encoder. So the caller (the ingress) hashes the bytes once and, for an
item larger than Ray inlines in a call, stores them once with ``ray.put`` and
passes the ``ObjectRef``. The registry borrows that ref and passes it to the
encoder replica as a top-level argument, which Ray resolves there. The bytes are
then in the object store once while the request is in flight, instead of once
per hop (caller -> registry -> encoder), and the registry's process never
copies them.

Small items travel inline (``data``): a call's arguments of 100 KB or less ride
in the call itself, so a ref would only add an object and its bookkeeping.

The ref is owned by the process that built the ``MediaInput`` (the ingress
replica serving the request). If that process dies before the encoder read the
bytes, the encode fails with ``unavailable`` and the client, whose connection
went with it, retries.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import ray
from ray.experimental import get_object_locations

from encoder.hashing import media_digest
from encoder.media import MediaError
from encoder.types import Media, Video

# Ray sends call arguments up to this size inside the call (its
# max_direct_call_object_size default); larger ones go through the object store.
INLINE_MAX_BYTES = 100 * 1024


@dataclasses.dataclass(frozen=True)
class MediaInput:
    digest: str  # encoder.hashing.media_digest of the bytes: the mm_hash without the model
    data: Media | None = None  # the bytes themselves, for small items
    ref: Any = None  # ray.ObjectRef of the bytes, for the others
    nbytes: int = 0  # the media's bytes (held until the encode ends: max_pending_input_bytes)

    @property
    def payload(self) -> Any:
        """What the encoder call takes: the bytes, or the ref Ray resolves to them."""
        return self.ref if self.ref is not None else self.data


def _nbytes(media: Media) -> int:
    return sum(len(f) for f in media.frames) if isinstance(media, Video) else len(media)


# What Ray's serialization adds to a bytes object of the caller's (measured: 3 bytes).
_SERIALIZATION_BYTES = 1024


async def ref_input(ref: Any, max_bytes: int, timeout_s: float) -> MediaInput:
    """The ``MediaInput`` of image bytes a caller stored already (``ray.put(data)``): read here
    once to hash and check them (a copy in this process's memory, not in the store), then
    passed on as that ref when large, so the store holds them once. Awaited (the Ingress's
    loop never blocks on it); raises ``MediaError`` for anything that is not readable image
    bytes within the limit."""
    late = MediaError(f"the image_ref was not readable within {timeout_s:g} s (is the task that makes it done?)")
    deadline = time.monotonic() + timeout_s
    try:
        # Its size first, from where it lives: one over the limit is refused unread. Ray has
        # no awaitable wait that leaves the object where it is: these two run in a thread.
        ready, _ = await asyncio.to_thread(ray.wait, [ref], timeout=timeout_s, fetch_local=False)
        if not ready:
            raise late
        locations = await asyncio.to_thread(get_object_locations, [ref])
        size = locations.get(ref, {}).get("object_size")
        if size is not None and size > max_bytes + _SERIALIZATION_BYTES:
            raise MediaError(f"the image_ref holds {size} bytes; the limit is {max_bytes} bytes (it was not read)")
        data = await asyncio.wait_for(ref, max(deadline - time.monotonic(), 0.001))
    except TimeoutError:
        raise late from None
    except ray.exceptions.RayError as exc:
        raise MediaError(f"the image_ref cannot be read: {type(exc).__name__}") from None
    if not isinstance(data, bytes):
        raise MediaError(f"the image_ref must hold the image file's bytes, got {type(data).__name__}")
    if not data:
        raise MediaError("the image is empty")
    if len(data) > max_bytes:
        raise MediaError(f"the image is {len(data)} bytes; the limit is {max_bytes} bytes")
    digest = await asyncio.to_thread(media_digest, data)
    if len(data) <= INLINE_MAX_BYTES:
        return MediaInput(digest, data=data, nbytes=len(data))
    return MediaInput(digest, ref=ref, nbytes=len(data))


def media_input(media: Media, inline_max_bytes: int = INLINE_MAX_BYTES) -> MediaInput:
    """Hash ``media`` and, if it is larger than ``inline_max_bytes``, store it once (``ray.put``)."""
    digest, nbytes = media_digest(media), _nbytes(media)
    if nbytes <= inline_max_bytes:
        return MediaInput(digest, data=media, nbytes=nbytes)
    return MediaInput(digest, ref=ray.put(media), nbytes=nbytes)
