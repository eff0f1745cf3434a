"""Gemma 3: its SigLIP tower and the projector that pools, normalises and projects.

The output for one image is ``Gemma3Model.get_image_features(...).pooler_output`` for
the image's pixels: the tower's last hidden state (after its final layer norm), average
pooled to ``mm_tokens_per_image`` tokens, RMS-normed and projected, ``[256, hidden]``
for Gemma 3's own checkpoints. That is what vLLM's ``Gemma3ForConditionalGeneration``
caches per image.

Preprocessing is ``Gemma3ImageProcessorPil`` called as ``Gemma3Processor`` calls it:
pan-and-scan off, as transformers' processor and vLLM leave it unless asked (vLLM:
``mm_processor_kwargs={"do_pan_and_scan": True}``). With the ``pan_and_scan`` option
the crops follow the full image, and the embedding is every crop's tokens in order,
as vLLM's ``_process_image_input`` concatenates them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import Gemma3Config, Gemma3Processor, SiglipVisionConfig
from transformers.models.gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

from encoder.projected import ProjectedTowerEncoder
from encoder.spec import EncoderSpec, spec_options


@dataclasses.dataclass(frozen=True)
class Gemma3Options:
    seed: int = 0  # the tiny model's weights, when there is no path
    pan_and_scan: bool = False  # as vLLM's do_pan_and_scan; both default to off
    max_decode_pixels: int = 64 * 1024 * 1024


class Gemma3Encoder(ProjectedTowerEncoder):
    model_type = "gemma3"
    config_class = Gemma3Config
    image_processor_class = Gemma3ImageProcessorPil
    # 112 px / 14 px = 8x8 patches pooled 2x2 to 16 tokens, into a 256-wide language model.
    tiny = dict(
        vision_config=SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, image_size=112, patch_size=14,
                                         vision_use_head=False).to_dict(),
        text_config=dict(hidden_size=256, vocab_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=128,
                         intermediate_size=64),
        mm_tokens_per_image=16,
    )

    def make_projector(self, config: Any) -> torch.nn.Module:
        projector = Gemma3MultiModalProjector(config)
        # It starts as zeros (training fills it), which would embed every image to 0 in the
        # tiny seeded model; a checkpoint's weights replace this (skipped when loading one).
        torch.nn.init.normal_(projector.mm_input_projection_weight, std=config.initializer_range)
        return projector

    def processor_settings(self, options: Gemma3Options) -> dict[str, Any]:
        return {**Gemma3Processor.images_kwargs, "do_pan_and_scan": options.pan_and_scan}

    def default_processor(self) -> Any:
        side = self.config.vision_config.image_size
        return Gemma3ImageProcessorPil(size={"height": side, "width": side})

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.projector(self.tower(pixel_values=pixels, return_dict=True).last_hidden_state)


OPTIONS = Gemma3Options


def build(spec: EncoderSpec, device: torch.device, dtype: torch.dtype) -> Gemma3Encoder:
    return Gemma3Encoder(spec.family, spec.path, spec_options(Gemma3Options, spec), device, dtype)
