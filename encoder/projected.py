"""A fixed-size vision tower and its projector, read from a full multimodal checkpoint,
for models whose processor may cut one image into several tower inputs (tiles or crops).

An item's pixels are ``[tiles, 3, side, side]`` as the model's own processor makes them;
its embedding is the projector's output for every tile, in tile order, flattened to
``[tiles * tokens_per_tile, hidden]``: what vLLM's model returns for one image from
``embed_multimodal`` (and so what its encoder cache holds) and what transformers'
``get_image_features(...).pooler_output`` gives for that image's tiles, flattened.
Items with the same tile count share one forward pass.

A family subclasses :class:`ProjectedTowerEncoder` and sets the checkpoint's
``model_type``, its config class, the tiny seeded config, the image processor class
and the processor's call settings, and implements ``make_projector`` and
``features`` (pixels of tiles -> ``[tiles, tokens, hidden]``). Only the tower's and
projector's tensors are read from the checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch
from transformers import AutoConfig, AutoModel

from encoder.base import StackingEncoder
from encoder.checkpoint import CheckpointError, checkpoint_identity, construct, load_submodule, tensor_files
from encoder.media import open_image
from encoder.types import PreparedItem

# transformers 5 saves these models' towers and projectors at the top level; the layout
# transformers 4.52+ wrote (and some Hub checkpoints have) nests them under ``model.``.
TOWER_PREFIXES = ("vision_tower.", "model.vision_tower.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


class ProjectedTowerEncoder(StackingEncoder):
    model_type: str  # config.json's model_type for this family
    config_class: type  # the full model's config class (the tiny model is built from it)
    tiny: dict[str, Any]  # the tiny seeded model's config, without model.path
    image_processor_class: type

    def __init__(self, family: str, path: str | None, options: Any, device: torch.device, dtype: torch.dtype):
        self.family, self.device, self.dtype, self.options = family, device, dtype, options
        self.config = config = self._config(path)
        files = None if path is None else tensor_files(path)  # fails fast when there are no weights
        tower, projector = construct(
            lambda: (AutoModel.from_config(config.vision_config), self.make_projector(config)),
            seed=options.seed, from_checkpoint=files is not None,
        )
        self.loaded_keys: list[str] = []
        if files is not None:
            self.loaded_keys = load_submodule(tower, path, TOWER_PREFIXES, files)
            self.loaded_keys += load_submodule(projector, path, PROJECTOR_PREFIXES, files)
        self.tower = tower.to(device=device, dtype=dtype).eval()
        self.projector = projector.to(device=device, dtype=dtype).eval()
        self.processor = self._processor(path)
        self.processor_kwargs = self.processor_settings(options)
        patch = config.vision_config.patch_size
        self.min_side = patch[0] if isinstance(patch, (list, tuple)) else patch
        weights = checkpoint_identity(path) if path else f"seed={options.seed}"
        settings = json.dumps(self.processor_kwargs, sort_keys=True)
        self.identity = f"{family}:{weights}:{self.processor.to_json_string()}:{settings}:{dtype}"

    # -- the family's hooks ------------------------------------------------------------

    def make_projector(self, config: Any) -> torch.nn.Module:
        raise NotImplementedError

    def processor_settings(self, options: Any) -> dict[str, Any]:
        """What the model's processor passes its image processor on each call (they
        override the image processor's own config, as in transformers' processors)."""
        raise NotImplementedError

    def default_processor(self) -> Any:
        """The image processor when the directory has no ``preprocessor_config.json``."""
        raise NotImplementedError

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[tiles, 3, side, side]`` -> ``[tiles, tokens, hidden]``, as transformers'
        ``get_image_features(...).pooler_output``."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------

    def _config(self, path: str | None) -> Any:
        if path is None:
            return self.config_class(**self.tiny)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if config.model_type != self.model_type:
            raise CheckpointError(
                f"{path} holds a {config.model_type!r} model, not {self.family} (model_type {self.model_type!r}); "
                "set model.family to match it"
            )
        return config

    def _processor(self, path: str | None) -> Any:
        if path is not None and os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            return self.image_processor_class.from_pretrained(path, local_files_only=True)
        return self.default_processor()

    def preprocess(self, data: bytes) -> PreparedItem:
        image = open_image(data, max_pixels=self.options.max_decode_pixels, min_side=self.min_side)
        out = self.processor(images=[image], return_tensors="pt", **self.processor_kwargs)
        pixels = out["pixel_values"]  # every tile of this one image
        return PreparedItem(pixels=pixels, mm_hash=self.mm_hash(data), meta={"tiles": int(pixels.shape[0])},
                            batch_key=tuple(pixels.shape))

    def forward(self, pixels: torch.Tensor, batch_key: tuple) -> Sequence[torch.Tensor]:
        items, tiles = pixels.shape[:2]
        embedded = self.features(pixels.flatten(0, 1))
        return embedded.reshape(items, tiles * embedded.shape[1], embedded.shape[2]).unbind(0)
