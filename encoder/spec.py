"""What to build: ``EncoderSpec`` and the family table (no torch: config validation uses it).

The app's config is validated in processes that never run a model (the ingress,
the ``serve`` CLI), so the family names live here. Adding a family is one module
and one row of :data:`FAMILY_TABLE`: the module defines ``OPTIONS`` (a dataclass
of its ``model.options``) and ``build(spec, device, dtype)``; the config's family
list, the loader and the table in docs/models.md all come from the row.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class EncoderSpec:
    """Which model to build and where. ``options`` are family-specific settings."""

    family: str = "qwen2_5_vl"
    path: str | None = None  # a local Hugging Face model directory; None: the family's tiny seeded model
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # "auto": CUDA when torch sees a GPU, else CPU
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Family:
    """One row of the family table; ``what`` and ``metadata`` are the docs' words."""

    name: str
    module: str  # defines OPTIONS and build(spec, device, dtype)
    what: str
    metadata: str = ""


FAMILY_TABLE: tuple[Family, ...] = (
    Family("qwen2_5_vl", "encoder.qwen_vl",
           "Qwen2.5-VL vision tower and patch merger (`transformers`); images and videos",
           "`grid_thw`: [t, h, w] patches before merging, per image or video; tokens = t·h·w/4; `frames` for videos"),
    Family("qwen2_vl", "encoder.qwen_vl", "Qwen2-VL vision tower and patch merger; images and videos",
           "as `qwen2_5_vl`"),
    Family("qwen3_vl", "encoder.qwen3_vl",
           "Qwen3-VL or Qwen3.5 vision tower and patch merger, with Qwen3-VL's DeepStack levels concatenated "
           "on the hidden axis (width `out_hidden_size` × (1 + levels), as vLLM caches it); images",
           "`grid_thw`: [1, h, w] patches before merging; tokens = h·w/4"),
    Family("llava", "encoder.llava",
           "a LLaVA checkpoint's CLIP or SigLIP tower, `vision_feature_layer` / `vision_feature_select_strategy` "
           "as configured, then its projector"),
    Family("clip", "encoder.llava", "a bare CLIP vision tower directory (no projector): the chosen layer's hidden states"),
    Family("siglip", "encoder.llava", "a bare SigLIP vision tower directory (no projector): the chosen layer's hidden states"),
    Family("gemma3", "encoder.gemma3",
           "Gemma 3's SigLIP tower, then its projector (average pooling to `mm_tokens_per_image`, norm, projection)",
           "`tiles`: 1, or 1 + crops with `pan_and_scan`; tokens = tiles · `mm_tokens_per_image`"),
    Family("internvl", "encoder.internvl",
           "InternVL in transformers' format (`model_type` `internvl`): InternViT tower, pixel shuffle, projector; "
           "dynamic tiling as vLLM does it (on, `max_patches` from the checkpoint)",
           "`tiles`: tiles plus thumbnail; tokens = tiles · `image_seq_length`"),
    Family("tiny-vit", "encoder.tiny_vit", "a 2-layer seeded ViT of this project (tests and benchmarks)",
           "`grid`: [rows, cols]"),
)
FAMILIES: tuple[str, ...] = tuple(row.name for row in FAMILY_TABLE)


def family(name: str) -> Family:
    for row in FAMILY_TABLE:
        if row.name == name:
            return row
    raise ValueError(f"unknown model family {name!r}; choose one of {list(FAMILIES)}")


def spec_options(cls: type, spec: EncoderSpec) -> Any:
    """``spec.options`` as the family's options dataclass; unknown keys are named."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(spec.options) - known
    if unknown:
        raise ValueError(f"unknown {spec.family} options {sorted(unknown)}; known: {sorted(known)}")
    return cls(**spec.options)


def families_markdown() -> str:
    """The family table of docs/models.md."""
    lines = ["| `model.family` | what | item metadata |", "|---|---|---|"]
    lines += [f"| `{row.name}` | {row.what} | {row.metadata} |" for row in FAMILY_TABLE]
    return "\n".join(lines) + "\n"
