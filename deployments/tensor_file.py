"""A request's staged items as one safetensors file, written without torch.

The HTTP pull route (``GET /v1/requests/{req_id}/items``) answers with this
file. The Ingress handles payloads as numpy arrays (``encoder.types``) and must
not import torch (seconds and hundreds of MB per replica), so the format is
written here by hand; it is small and fixed
(https://huggingface.co/docs/safetensors): an 8-byte little-endian header length,
a JSON header naming each tensor's dtype, shape and byte range, then the bytes.

Tensors are ``item_0``, ``item_1``, ... in item order. The header's
``__metadata__`` (string to string, as the format requires) holds ``req_id``,
``count`` and, per item, ``item_<i>``: that item's metadata as JSON. bfloat16
payloads travel as int16 bits and are declared ``BF16``, so a reader gets
bfloat16 back bit for bit.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

# wire dtype name (``encoder.types``) -> safetensors dtype
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
# The data section starts on an 8-byte boundary (readers may map it and view it in place).
_ALIGN = 8


def safetensors_bytes(req_id: str, items: list[tuple[dict[str, Any], np.ndarray]]) -> bytes:
    """One safetensors file holding each (meta, payload) of ``items`` as ``item_<i>``."""
    header: dict[str, Any] = {"__metadata__": {"req_id": req_id, "count": str(len(items))}}
    offset = 0
    buffers = []
    for i, (meta, payload) in enumerate(items):
        dtype = _DTYPES.get(meta.get("dtype", ""))
        if dtype is None:
            raise ValueError(f"item {i} has dtype {meta.get('dtype')!r}; safetensors carries {sorted(_DTYPES)}")
        data = np.ascontiguousarray(payload)
        header[f"item_{i}"] = {"dtype": dtype, "shape": list(meta["shape"]), "data_offsets": [offset, offset + data.nbytes]}
        header["__metadata__"][f"item_{i}"] = json.dumps(meta, separators=(",", ":"))
        offset += data.nbytes
        buffers.append(memoryview(data).cast("B"))
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % _ALIGN)
    # One copy of the payloads: into the answer's body.
    return b"".join([struct.pack("<Q", len(encoded)), encoded, *buffers])
