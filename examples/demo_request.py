"""What the decoder examples share: a demo image, and encoding it over HTTP.

Plain Python (numpy, Pillow, the standard library): the ZMQ and HTTP examples run
in processes that never join the Ray cluster.
"""

from __future__ import annotations

import base64
import io
import json
import os
import urllib.request

import numpy as np
from PIL import Image


def headers() -> dict[str, str]:
    """JSON, and the service's bearer token when ``EPD_API_TOKEN`` holds one."""
    token = os.environ.get("EPD_API_TOKEN")
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}


def post_encode(url: str, image: bytes, receive_count: int) -> dict:
    body = {
        "receive_count": receive_count,
        "items": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}],
    }
    request = urllib.request.Request(f"{url}/v1/encode", data=json.dumps(body).encode(), headers=headers())
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def demo_image() -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, size=(224, 320, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def summary(index: int, tensor) -> dict:
    """What a rank got for one item: its index, shape, dtype and the sha256 of its bytes."""
    import hashlib

    import torch  # the caller has it: it made the tensor

    return {
        "index": index,
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "sha256": hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes()).hexdigest(),
    }
