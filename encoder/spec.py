"""What to build: ``EncoderSpec`` and the family names (no torch: config validation uses it).

The app's config is validated in processes that never run a model (the ingress,
the ``serve`` CLI), so the names live here and ``encoder.loader`` maps each to
its builder.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FAMILIES = ("tiny-vit", "qwen2_5_vl", "qwen2_vl", "llava", "clip", "siglip")


@dataclasses.dataclass(frozen=True)
class EncoderSpec:
    """Which model to build and where. ``options`` are family-specific settings."""

    family: str = "qwen2_5_vl"
    path: str | None = None  # a local Hugging Face model directory; None: the family's tiny seeded model
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # "auto": CUDA when torch sees a GPU, else CPU
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
