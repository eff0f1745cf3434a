"""Plain data that crosses the encoder's boundary, and the tensor <-> bytes codec.

An embedding travels from the encoder replica to the decoder ranks as an
``EncodedItem``: a small metadata dict plus one C-contiguous numpy array.
Numpy is the transport on purpose: Ray stores numpy buffers out of band and a
same-node ``ray.get`` maps them without a copy, while a ``torch.Tensor`` would be
copied on every read. bfloat16 has no numpy dtype, so its bits travel as int16
and are viewed back as bfloat16 on the receiving side (a view, not a copy).

torch is imported only by the functions that need it: the ingress and the
registry handle these types (media, staged items' metadata) and never a tensor,
and importing torch would cost each of their processes seconds and memory.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# wire name (the torch dtype's name) -> numpy dtype carrying the same bits
_CODEC: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.int16),
}

DTYPES = tuple(_CODEC)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _CODEC:
        raise ValueError(f"unsupported embedding dtype {dtype}; use one of {DTYPES}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    import torch

    if name not in _CODEC:
        raise ValueError(f"unsupported embedding dtype {name!r}; use one of {DTYPES}")
    return getattr(torch, name)


def tensor_to_payload(tensor: torch.Tensor) -> np.ndarray:
    """Move ``tensor`` to host memory as a numpy array with the same bits.

    This is the one host copy of an embedding (device -> host, or none on CPU
    when the tensor is already contiguous). Same-dtype views keep bfloat16 exact.
    """
    import torch

    name = dtype_name(tensor.dtype)
    host = tensor.detach().contiguous().cpu()
    if name == "bfloat16":
        host = host.view(torch.int16)
    return host.numpy()


def payload_to_tensor(payload: np.ndarray, dtype: str) -> torch.Tensor:
    """View a payload array as a torch tensor of ``dtype`` without copying.

    Arrays read from Ray's object store are read-only; torch cannot mark a tensor
    read-only, so it warns. The warning is silenced here and the contract is
    documented instead: received tensors must not be written in place.
    """
    import torch

    want_torch = torch_dtype(dtype)
    if payload.dtype != _CODEC[dtype]:
        raise ValueError(f"payload dtype {payload.dtype} does not carry {dtype}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(payload)
    return tensor.view(want_torch) if dtype == "bfloat16" else tensor


@dataclasses.dataclass(frozen=True, slots=True)
class Video:
    """A video item as the frames' encoded image bytes, in order (an image item is plain ``bytes``)."""

    frames: tuple[bytes, ...]


#: What one request item carries from the ingress to the encoder.
Media = bytes | Video


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedItem:
    """One decoded, preprocessed media item, ready for the vision tower.

    ``pixels`` stays on the CPU; the encoder moves whole batches to its device.
    ``batch_key`` groups items whose pixels can be stacked into one forward pass.
    """

    pixels: torch.Tensor
    mm_hash: str
    meta: dict[str, Any]
    batch_key: tuple


@dataclasses.dataclass(frozen=True, slots=True)
class EncodedItem:
    """One item's embedding as staged: metadata plus the payload array.

    ``meta`` always holds ``mm_hash``, ``shape``, ``dtype`` and ``nbytes``, plus
    model-specific fields (the tiny model adds ``grid``: patch rows and columns).
    """

    meta: dict[str, Any]
    payload: np.ndarray

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, prepared: PreparedItem) -> "EncodedItem":
        payload = tensor_to_payload(tensor)
        meta = {
            **prepared.meta,
            "mm_hash": prepared.mm_hash,
            "shape": list(tensor.shape),
            "dtype": dtype_name(tensor.dtype),
            "nbytes": int(payload.nbytes),
        }
        return cls(meta=meta, payload=payload)

    def tensor(self) -> torch.Tensor:
        """The embedding as a torch tensor of its staged dtype (zero-copy view)."""
        return payload_to_tensor(self.payload, self.meta["dtype"])
