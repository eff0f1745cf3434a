"""CLIP and SigLIP vision towers, with the LLaVA projector where the checkpoint has one.

Families:

* ``llava``: a full LLaVA checkpoint (CLIP or SigLIP tower, two-layer projector,
  language model). The output is what the LM consumes, exactly as
  ``LlavaModel.get_image_features`` computes it: the hidden states of
  ``vision_feature_layer``, the CLS token dropped for the ``"default"`` strategy,
  through the projector. Without ``path``: a tiny seeded LLaVA-CLIP tower.
* ``clip`` / ``siglip``: a directory holding only the vision tower; the output
  is the chosen layer's hidden states (no projector).

Images are resized to the tower's fixed input size, so every item has the same
shape and a batch is one stacked forward pass. Only the tower's and projector's
weights are read from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import torch
from transformers import AutoConfig, AutoModel, CLIPVisionConfig, LlavaConfig
from transformers.models.clip import CLIPImageProcessorPil
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
from transformers.models.siglip import SiglipImageProcessorPil

from encoder.base import StackingEncoder
from encoder.checkpoint import CheckpointError, checkpoint_identity, construct, load_submodule, tensor_files
from encoder.media import open_image
from encoder.spec import EncoderSpec, spec_options
from encoder.types import PreparedItem

_TOWER_PREFIXES = ("vision_tower.", "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
_VISION_ONLY_PREFIXES = ("", "vision_model.")
_VISION_TYPES = {"clip": ("clip_vision_model", "clip"), "siglip": ("siglip_vision_model", "siglip")}

_TINY = dict(
    vision_config=CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=112, patch_size=14
    ).to_dict(),
    text_config=dict(model_type="llama", hidden_size=256, vocab_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64),
)


@dataclasses.dataclass(frozen=True)
class LlavaOptions:
    seed: int = 0  # the tiny tower's weights, when there is no path
    feature_layer: int | None = None  # None: the LLaVA config's, or -1 for a bare tower
    select_strategy: str | None = None  # "default" (drop CLS) or "full"; None: as feature_layer
    max_decode_pixels: int = 64 * 1024 * 1024


class LlavaEncoder(StackingEncoder):
    def __init__(self, family: str, path: str | None, options: LlavaOptions, device: torch.device, dtype: torch.dtype):
        self.family, self.device, self.dtype, self.options = family, device, dtype, options
        config = self._config(family, path)
        vision_config = config.vision_config if isinstance(config, LlavaConfig) else config
        files = None if path is None else tensor_files(path)  # fails fast when there are no weights
        tower, projector = construct(
            lambda: (
                AutoModel.from_config(vision_config),
                LlavaMultiModalProjector(config) if isinstance(config, LlavaConfig) else None,
            ),
            seed=options.seed,
            from_checkpoint=files is not None,
        )
        self.loaded_keys: list[str] = []
        if files is not None:
            if projector is None:
                self.loaded_keys = load_submodule(tower, path, _VISION_ONLY_PREFIXES, files)
            else:
                self.loaded_keys = load_submodule(tower, path, _TOWER_PREFIXES, files)
                self.loaded_keys += load_submodule(projector, path, _PROJECTOR_PREFIXES, files)
        self.tower = tower.to(device=device, dtype=dtype).eval()
        self.projector = None if projector is None else projector.to(device=device, dtype=dtype).eval()
        llava = isinstance(config, LlavaConfig)
        self.feature_layer = options.feature_layer if options.feature_layer is not None else (
            config.vision_feature_layer if llava else -1
        )
        self.select_strategy = options.select_strategy or (config.vision_feature_select_strategy if llava else "full")
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f'select_strategy must be "default" or "full", got {self.select_strategy!r}')
        self.patch_size = vision_config.patch_size
        self.processor = self._processor(vision_config, path)
        weights = checkpoint_identity(path) if path else f"seed={options.seed}"
        self.identity = (
            f"{family}:{weights}:{self.processor.to_json_string()}:{self.feature_layer}:{self.select_strategy}:{dtype}"
        )

    @staticmethod
    def _config(family: str, path: str | None) -> Any:
        if path is None:
            if family != "llava":
                raise CheckpointError(f"model family {family!r} needs model.path (a local vision tower directory)")
            return LlavaConfig(**_TINY)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        expected = ("llava",) if family == "llava" else _VISION_TYPES[family]
        if config.model_type not in expected:
            raise CheckpointError(f"{path} holds a {config.model_type!r} model, not {family}; set model.family to match it")
        return getattr(config, "vision_config", config) if family != "llava" else config

    @staticmethod
    def _processor(vision_config: Any, path: str | None) -> Any:
        siglip = vision_config.model_type.startswith("siglip")
        cls = SiglipImageProcessorPil if siglip else CLIPImageProcessorPil
        if path is not None and os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            return cls.from_pretrained(path, local_files_only=True)
        side = vision_config.image_size
        if siglip:
            return cls(size={"height": side, "width": side})
        return cls(size={"shortest_edge": side}, crop_size={"height": side, "width": side})

    def preprocess(self, data: bytes) -> PreparedItem:
        image = open_image(data, max_pixels=self.options.max_decode_pixels, min_side=self.patch_size)
        pixels = self.processor(images=[image], return_tensors="pt")["pixel_values"][0]
        return PreparedItem(pixels=pixels, mm_hash=self.mm_hash(data), meta={}, batch_key=tuple(pixels.shape))

    def forward(self, pixels: torch.Tensor, batch_key: tuple) -> Sequence[torch.Tensor]:
        hidden = self.tower(pixels, output_hidden_states=True, return_dict=True).hidden_states[self.feature_layer]
        if self.select_strategy == "default":
            hidden = hidden[:, 1:]
        if self.projector is not None:
            hidden = self.projector(hidden)
        return hidden.unbind(0)


OPTIONS = LlavaOptions


def build(spec: EncoderSpec, device: torch.device, dtype: torch.dtype) -> LlavaEncoder:
    return LlavaEncoder(spec.family, spec.path, spec_options(LlavaOptions, spec), device, dtype)
