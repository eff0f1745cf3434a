"""InternVL in transformers' format (``InternVLForConditionalGeneration``, model_type
``internvl``): the InternViT tower, pixel shuffle and the MLP projector.

Per tile the output is ``InternVLModel.get_image_features(...).pooler_output``: the
configured layer's hidden states (``vision_feature_layer``, -1: the last, after the
tower's final norm), CLS dropped for the ``"default"`` strategy, pixel-shuffled by
``downsample_ratio`` and projected. One image's embedding is its tiles' outputs in
order, ``[tiles * image_seq_length, hidden]``: what vLLM's model for this format
(``InternS1ForConditionalGeneration``) returns for the image and caches.

Dynamic tiling follows vLLM's default for this format, which is transformers'
``InternVLProcessor``'s: ``crop_to_patches=True`` (the processor passes it over the image
processor's own ``false``), so an image is cut into the checkpoint's
``min_patches``..``max_patches`` tiles of the best-fitting aspect ratio, plus a thumbnail
when there is more than one. ``crop_to_patches: false`` gives one tile (what vLLM gives
with ``mm_processor_kwargs={"crop_to_patches": False}``); ``max_patches`` overrides the
checkpoint's as vLLM's ``mm_processor_kwargs`` would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import InternVLConfig, InternVLProcessor
from transformers.models.got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.internvl.modeling_internvl import InternVLModel, InternVLMultiModalProjector

from encoder.projected import ProjectedTowerEncoder
from encoder.spec import EncoderSpec, spec_options


@dataclasses.dataclass(frozen=True)
class InternVLOptions:
    seed: int = 0  # the tiny model's weights, when there is no path
    crop_to_patches: bool = True  # dynamic tiling, on as in vLLM and InternVLProcessor
    max_patches: int | None = None  # None: the checkpoint's preprocessor_config.json
    max_decode_pixels: int = 64 * 1024 * 1024


class InternVLEncoder(ProjectedTowerEncoder):
    model_type = "internvl"
    config_class = InternVLConfig
    image_processor_class = GotOcr2ImageProcessorPil
    # 112 px / 14 px = 8x8 patches, shuffled to 16 tokens per tile, into a 256-wide language model.
    tiny = dict(
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           image_size=[112, 112], patch_size=[14, 14]),
        text_config=dict(model_type="qwen2", hidden_size=256, vocab_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=64),
        image_seq_length=16,
    )

    def make_projector(self, config: Any) -> torch.nn.Module:
        return InternVLMultiModalProjector(config)

    def processor_settings(self, options: InternVLOptions) -> dict[str, Any]:
        settings = {**InternVLProcessor.images_kwargs, "crop_to_patches": options.crop_to_patches}
        if options.max_patches is not None:
            settings["max_patches"] = options.max_patches
        return settings

    def default_processor(self) -> Any:
        height, width = self.config.vision_config.image_size
        return GotOcr2ImageProcessorPil(size={"height": height, "width": width})

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        layer = self.config.vision_feature_layer
        out = self.tower(pixel_values=pixels, output_hidden_states=layer != -1, return_dict=True)
        hidden = out.last_hidden_state if layer == -1 else out.hidden_states[layer]
        if self.config.vision_feature_select_strategy == "default":
            hidden = hidden[:, 1:]
        side = int(hidden.shape[1] ** 0.5)
        # transformers' own pixel shuffle; it reads nothing from ``self``.
        hidden = InternVLModel.pixel_shuffle(self, hidden.reshape(hidden.shape[0], side, side, -1),
                                             scale_factor=self.config.downsample_ratio)
        return self.projector(hidden.reshape(hidden.shape[0], -1, hidden.shape[-1]))


OPTIONS = InternVLOptions


def build(spec: EncoderSpec, device: torch.device, dtype: torch.dtype) -> InternVLEncoder:
    return InternVLEncoder(spec.family, spec.path, spec_options(InternVLOptions, spec), device, dtype)
