"""Content hashes of media items (no torch: the ingress and the registry use these).

``media_digest`` hashes the bytes alone, once, where they arrive; ``mm_hash``
puts a digest under a model identity. The encoder computes the same ``mm_hash``
from the bytes it embeds, so the registry can find and share embeddings by it
without ever reading the bytes.
"""

from __future__ import annotations

import hashlib

from encoder.types import Media, Video


def media_digest(media: Media) -> str:
    """The digest of an item's bytes alone (no model): what callers compute once and
    hand on, so that nothing downstream has to read the bytes to hash them."""
    if isinstance(media, Video):
        digest = hashlib.blake2b(b"video", digest_size=16, person=b"epd-media")
        for frame in media.frames:  # length-prefixed, so frame boundaries count
            digest.update(len(frame).to_bytes(8, "little"))
            digest.update(frame)
    else:
        digest = hashlib.blake2b(media, digest_size=16, person=b"epd-media")
    return digest.hexdigest()


def mm_hash(digest: str, identity: str) -> str:
    """``mm_hash`` from a ``media_digest`` and a model identity."""
    return hashlib.blake2b(f"{digest}:{identity}".encode(), digest_size=16, person=b"epd-mm-hash").hexdigest()


def content_hash(media: Media, identity: str) -> str:
    """``mm_hash``: the item's bytes under a model identity. The registry computes it
    too (from the caller's digest and the identity the encoder reports) to find cached
    embeddings."""
    return mm_hash(media_digest(media), identity)
