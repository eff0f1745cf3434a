"""Building a ``VisionEncoder`` from a plain spec, and choosing its device.

The serving layer validates user config (pydantic, at the edge) and hands this
module an ``EncoderSpec``. Families are looked up by name so a new one is one
entry in ``_FAMILIES`` and its name in ``encoder.spec.FAMILIES``; the
``transformers``-based ones are imported only when asked for (importing
``transformers`` takes seconds).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import torch

from encoder.base import VisionEncoder
from encoder.spec import FAMILIES, EncoderSpec
from encoder.tiny_vit import TinyViTConfig, TinyViTEncoder
from encoder.types import torch_dtype


def resolve_device(requested: str) -> torch.device:
    """The device to run on. Ray sets CUDA_VISIBLE_DEVICES for ``num_gpus`` replicas;
    torch then sees exactly the assigned GPU, so ask torch, not Ray (a CPU machine
    that Ray was told has fake GPUs must still run on the CPU)."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"model device {requested!r} was asked for but torch sees no GPU; "
            'use device: "auto" or give the replica num_gpus: 1'
        )
    return device


def resolve_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch_dtype(requested)


def _options(cls: type, spec: EncoderSpec) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(spec.options) - known
    if unknown:
        raise ValueError(f"unknown {spec.family} options {sorted(unknown)}; known: {sorted(known)}")
    return cls(**spec.options)


def _tiny_vit(spec: EncoderSpec, device: torch.device, dtype: torch.dtype) -> VisionEncoder:
    if spec.path is not None:
        raise ValueError("tiny-vit is built from its options and takes no model.path")
    return TinyViTEncoder(_options(TinyViTConfig, spec), device, dtype)


def _qwen_vl(spec: EncoderSpec, device: torch.device, dtype: torch.dtype) -> VisionEncoder:
    from encoder.qwen_vl import QwenVLEncoder, QwenVLOptions

    return QwenVLEncoder(spec.family, spec.path, _options(QwenVLOptions, spec), device, dtype)


def _llava(spec: EncoderSpec, device: torch.device, dtype: torch.dtype) -> VisionEncoder:
    from encoder.llava import LlavaEncoder, LlavaOptions

    return LlavaEncoder(spec.family, spec.path, _options(LlavaOptions, spec), device, dtype)


_FAMILIES: dict[str, Callable[[EncoderSpec, torch.device, torch.dtype], VisionEncoder]] = {
    "tiny-vit": _tiny_vit,
    "qwen2_5_vl": _qwen_vl,
    "qwen2_vl": _qwen_vl,
    "llava": _llava,
    "clip": _llava,
    "siglip": _llava,
}



def build_encoder(spec: EncoderSpec) -> VisionEncoder:
    """Build the encoder ``spec`` names; raise ``ValueError`` with a fix on bad specs."""
    try:
        factory = _FAMILIES[spec.family]
    except KeyError:
        raise ValueError(f"unknown model family {spec.family!r}; choose one of {FAMILIES}") from None
    if spec.path is not None and not os.path.isdir(spec.path):
        raise ValueError(f"model.path {spec.path!r} is not a directory; give a local Hugging Face model directory")
    device = resolve_device(spec.device)
    return factory(spec, device, resolve_dtype(spec.dtype, device))
