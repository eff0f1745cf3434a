"""Qwen3-VL and Qwen3.5 vision towers (with their patch mergers), through ``transformers``: images.

Qwen3.5 reuses Qwen3-VL's tower without the DeepStack mergers, so one family
loads both: a full ``qwen3_vl`` or ``qwen3_5`` checkpoint, or a vision-only
directory of either (only the vision weights are read, as for Qwen2.5-VL).

The output per image is what vLLM's Qwen3-VL keeps in its encoder cache for the
item, and what SGLang's encoder server sends: the merger's output with each
DeepStack level's merger output concatenated on the hidden axis,
``[tokens, out_hidden_size * (1 + len(deepstack_visual_indexes))]``; the
language model splits it back and adds the levels to its first layers. Qwen3.5
has no levels, so its width is ``out_hidden_size``. ``grid_thw`` is in the item
metadata, as for Qwen2.5-VL.

Videos are refused: Qwen3-VL's prompt puts a timestamp before each frame group and
its video processor resizes frames by the whole clip's pixel budget, which the
image processor used here does not reproduce.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from encoder.media import MediaError
from encoder.qwen_vl import QwenVLEncoder, QwenVLOptions, Tower
from encoder.spec import EncoderSpec, spec_options
from encoder.types import PreparedItem, Video

_TINY = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256,
             num_position_embeddings=256, patch_size=16)


class Qwen3VLEncoder(QwenVLEncoder):
    """``meta["grid_thw"]``: [1, h, w] patches before merging; the width includes DeepStack's levels."""

    TOWERS = {"qwen3_vl": (
        # The tiny default is Qwen3-VL's: it has a DeepStack level, the case that widens the output.
        Tower("qwen3_vl", "qwen3_vl_vision", Qwen3VLVisionConfig, Qwen3VLVisionModel,
              dict(_TINY, deepstack_visual_indexes=[0])),
        Tower("qwen3_5", "qwen3_5_vision", Qwen3_5VisionConfig, Qwen3_5VisionModel, _TINY),
    )}
    # Qwen3-VL's released preprocessor_config.json normalises with mean = std = 0.5, not CLIP's.
    PROCESSOR_DEFAULTS = dict(min_pixels=64 * 64, max_pixels=448 * 448, image_mean=[0.5] * 3, image_std=[0.5] * 3)

    def preprocess_video(self, video: Video) -> PreparedItem:
        raise MediaError(
            "this model (Qwen3-VL / Qwen3.5) takes images only here: its videos need per-frame timestamps "
            "and its own video processor; send each frame as an image"
        )

    def merged(self, output: Any) -> torch.Tensor:
        # The order vLLM's Qwen3_VisionTransformer concatenates in: main output, then levels by index.
        return torch.cat([output.pooler_output, *(getattr(output, "deepstack_features", None) or ())], dim=-1)


OPTIONS = QwenVLOptions


def build(spec: EncoderSpec, device: torch.device, dtype: torch.dtype) -> Qwen3VLEncoder:
    return Qwen3VLEncoder(spec.family, spec.path, spec_options(QwenVLOptions, spec), device, dtype)
