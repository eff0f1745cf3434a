"""Test images for the end-to-end and memory sections: real PNGs, every request's bytes distinct.

The registry shares the encode of an item identical to one in flight (and the
cache, when on, reuses finished ones), so sending one image many times would
measure sharing, not encoding. Re-encoding a PNG per request costs the client
milliseconds; instead each copy of a base image gets a ``tEXt`` chunk holding a
nonce. The pixels, and so the model's work, are the same; the bytes, and so the
content hash, differ.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import numpy as np
from PIL import Image

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_IHDR_END = len(_SIGNATURE) + 8 + 13 + 4  # signature, IHDR length+type, 13 bytes of data, CRC


def png(side: int, seed: int) -> bytes:
    """A ``side`` x ``side`` PNG of random pixels (incompressible: the largest realistic input)."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def with_nonce(image: bytes, nonce: int) -> bytes:
    """``image`` with a ``tEXt`` chunk after the header: same pixels, different bytes."""
    if not image.startswith(_SIGNATURE):
        raise ValueError("not a PNG")
    data = b"nonce\x00" + str(nonce).encode()
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", zlib.crc32(b"tEXt" + data))
    return image[:_IHDR_END] + chunk + image[_IHDR_END:]


def request_pool(side: int, count: int, bases: int = 8, seed: int = 0) -> list[dict]:
    """``count`` encode bodies (``receive_count`` 1, one image item each), all with distinct bytes.

    ``bases`` distinct pictures, each repeated with different nonces, so that building
    the pool costs a few PNG encodes, not ``count``.
    """
    images = [png(side, seed + i) for i in range(bases)]
    return [
        {
            "receive_count": 1,
            "items": [{"type": "image", "image": base64.b64encode(with_nonce(images[i % bases], i)).decode()}],
        }
        for i in range(count)
    ]


def http_bodies(pool: list[dict]) -> list[bytes]:
    """The same bodies, serialized once for HTTP (the client should not spend its time on JSON)."""
    return [json.dumps(body).encode() for body in pool]
