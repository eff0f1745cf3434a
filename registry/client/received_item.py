"""What a decoder rank receives, whichever way it came: ``ReceivedItem``.

Ray-free (numpy and torch only), so receivers outside the Ray cluster
(``registry.client.zmq_receiver``) build the same objects as ``EmbeddingReceiver``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads when the first tensor is made
    import torch

_TORCH_DTYPES = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True, slots=True)
class ReceivedItem:
    """One item of a request: its embedding and its metadata (``index``, ``mm_hash``,
    ``shape``, ``dtype``, ``nbytes`` and model fields such as ``grid``)."""

    tensor: torch.Tensor
    meta: dict[str, Any]


def item_from_buffer(buffer: Any, meta: dict[str, Any]) -> ReceivedItem:
    """The item whose raw bytes are ``buffer`` (any buffer object, kept alive by the tensor),
    viewed as ``meta["dtype"]`` and ``meta["shape"]`` without a copy.

    A buffer whose address does not suit the dtype's alignment is copied once (small
    messages can sit anywhere in a socket's receive buffer). Read-only buffers make
    tensors torch cannot mark read-only: do not write to them in place.
    """
    import torch

    dtype_name, shape = meta.get("dtype"), meta.get("shape")
    if dtype_name not in _TORCH_DTYPES or not isinstance(shape, list):
        raise ValueError(f"an item needs dtype (one of {_TORCH_DTYPES}) and shape; got {dtype_name!r}, {shape!r}")
    dtype = getattr(torch, dtype_name)
    if memoryview(buffer).nbytes == 0:
        return ReceivedItem(torch.empty(shape, dtype=dtype), meta)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensor = torch.frombuffer(buffer, dtype=dtype)
    if tensor.numel() != math.prod(shape):
        raise ValueError(f"an item of shape {shape} holds {math.prod(shape)} {dtype_name} values; the bytes hold {tensor.numel()}")
    if tensor.data_ptr() % tensor.element_size():
        tensor = tensor.clone()
    return ReceivedItem(tensor.view(shape), meta)
