"""Building a ``VisionEncoder`` from a plain spec, and choosing its device.

The serving layer validates user config (pydantic, at the edge) and hands this
module an ``EncoderSpec``; its row of ``encoder.spec.FAMILY_TABLE`` names the module
that builds it.
"""

from __future__ import annotations

import importlib
import os

import torch

from encoder.base import VisionEncoder
from encoder.spec import EncoderSpec, family
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


def build_encoder(spec: EncoderSpec) -> VisionEncoder:
    """Build the encoder ``spec`` names; raise ``ValueError`` with a fix on bad specs."""
    row = family(spec.family)
    if spec.path is not None and not os.path.isdir(spec.path):
        raise ValueError(f"model.path {spec.path!r} is not a directory; give a local Hugging Face model directory")
    device = resolve_device(spec.device)
    # The transformers-based modules are imported only when asked for (seconds each).
    return importlib.import_module(row.module).build(spec, device, resolve_dtype(spec.dtype, device))
