"""Qwen2-VL and Qwen2.5-VL vision towers (with their patch merger), through ``transformers``: images and videos.

The output per image is what the language model consumes: the merger's output,
``grid_t * grid_h * grid_w / merge_size**2`` tokens of the LM's hidden size, with
``grid_thw`` in the item metadata (the LM needs it for its M-RoPE positions).

Batching packs items end to end (the tower takes variable-length sequences and
``grid_thw`` per item), as ``get_image_features`` does; an image alone and in a
batch gives bitwise-equal embeddings on the CPU.

Without ``path`` the tower is a tiny seeded one built from a config (the
embedded default: no download). With ``path`` it is read from a local
directory holding either the full model or only the vision tower; only vision
weights are read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import torch
from transformers import AutoConfig
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from encoder.base import VisionEncoder
from encoder.checkpoint import CheckpointError, checkpoint_identity, construct, load_submodule, tensor_files
from encoder.media import MediaError, open_image
from encoder.spec import EncoderSpec, spec_options
from encoder.types import PreparedItem, Video

# Where each family keeps its vision weights, in the checkpoint spellings seen in the wild.
_PREFIXES = ("visual.", "model.visual.", "")


@dataclasses.dataclass(frozen=True)
class Tower:
    """One checkpoint kind a family loads: how its config.json names it and what builds it."""

    full_type: str  # model_type of the full multimodal model
    vision_type: str  # model_type of a vision-only directory
    config_cls: type
    tower_cls: type
    tiny: dict  # the tiny seeded tower's config, when there is no path


# family -> the checkpoint kinds it loads; the first is the tiny default's.
_FAMILIES = {
    "qwen2_5_vl": (Tower(
        "qwen2_5_vl", "qwen2_5_vl_vision", Qwen2_5_VLVisionConfig, Qwen2_5_VisionTransformerPretrainedModel,
        dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256,
             window_size=112, fullatt_block_indexes=[1]),
    ),),
    "qwen2_vl": (Tower(
        "qwen2_vl", "qwen2_vl", Qwen2VLVisionConfig, Qwen2VisionTransformerPretrainedModel,
        dict(depth=2, embed_dim=64, num_heads=2, mlp_ratio=2, hidden_size=256),
    ),),
}


@dataclasses.dataclass(frozen=True)
class QwenVLOptions:
    seed: int = 0  # the tiny tower's weights, when there is no path
    min_pixels: int | None = None  # None: the checkpoint's preprocessor_config.json, else 56*56
    max_pixels: int | None = None  # None: the checkpoint's preprocessor_config.json, else 448*448
    max_decode_pixels: int = 64 * 1024 * 1024


def vision_config(family: str, path: str | None, towers: Sequence[Tower]) -> tuple[Any, type]:
    """The vision config in ``path`` (or the tiny one) and the tower class that takes it."""
    if path is None:
        return towers[0].config_cls(**towers[0].tiny), towers[0].tower_cls
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    for tower in towers:
        if config.model_type == tower.full_type and hasattr(config, "vision_config"):
            return config.vision_config, tower.tower_cls
        if config.model_type == tower.vision_type or isinstance(config, tower.config_cls):
            return config, tower.tower_cls
    raise CheckpointError(f"{path} holds a {config.model_type!r} model, not {family}; set model.family to match it")


class QwenVLEncoder(VisionEncoder):
    """``meta["grid_thw"]``: [t, h, w] patches before merging (t = 1 for images)."""

    TOWERS = _FAMILIES
    # The image processor's settings when the checkpoint has no preprocessor_config.json.
    PROCESSOR_DEFAULTS: dict[str, Any] = dict(min_pixels=56 * 56, max_pixels=448 * 448)

    def __init__(self, family: str, path: str | None, options: QwenVLOptions, device: torch.device, dtype: torch.dtype):
        self.family, self.device, self.dtype = family, device, dtype
        config, tower_cls = vision_config(family, path, self.TOWERS[family])
        files = None if path is None else tensor_files(path)  # fails fast when there are no weights
        tower = construct(lambda: tower_cls._from_config(config), seed=options.seed, from_checkpoint=files is not None)
        self.loaded_keys: list[str] = [] if files is None else load_submodule(tower, path, _PREFIXES, files)
        self.tower = tower.to(device=device, dtype=dtype).eval()
        self.merge = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.temporal_patch_size = config.temporal_patch_size
        self.processor = self._processor(config, path, options)
        self.options = options
        weights = checkpoint_identity(path) if path else f"seed={options.seed}"
        self.identity = f"{family}:{weights}:{self.processor.to_json_string()}:{dtype}"

    @classmethod
    def _processor(cls, config: Any, path: str | None, options: QwenVLOptions) -> Qwen2VLImageProcessorPil:
        settings: dict[str, Any] = {}
        if path is None or not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            settings = dict(
                patch_size=config.patch_size,
                merge_size=config.spatial_merge_size,
                temporal_patch_size=config.temporal_patch_size,
                **cls.PROCESSOR_DEFAULTS,
            )
        for key in ("min_pixels", "max_pixels"):
            if getattr(options, key) is not None:
                settings[key] = getattr(options, key)
        if path is not None and os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            return Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True, **settings)
        return Qwen2VLImageProcessorPil(**settings)

    def preprocess(self, data: bytes) -> PreparedItem:
        image = open_image(data, max_pixels=self.options.max_decode_pixels, min_side=self.patch_size)
        out = self.processor(images=[image], return_tensors="pt")
        grid = [int(v) for v in out["image_grid_thw"][0]]
        return PreparedItem(
            pixels=out["pixel_values"], mm_hash=self.mm_hash(data), meta={"grid_thw": grid}, batch_key=()
        )

    def preprocess_video(self, video: Video) -> PreparedItem:
        """Frames -> patches laid out as Qwen's video processor does: frames in groups of
        ``temporal_patch_size`` (the last repeated to fill a group), ``grid_thw`` = [groups, h, w].

        Built from the image processor (no torchvision): it emits each frame's patches with
        the frame repeated along the temporal axis; taking one copy per frame and stacking
        consecutive frames on that axis gives the video layout. Two identical frames
        therefore embed exactly like the image alone.
        """
        images = [open_image(f, max_pixels=self.options.max_decode_pixels, min_side=self.patch_size) for f in video.frames]
        for index, image in enumerate(images[1:], start=1):
            if image.size != images[0].size:
                raise MediaError(
                    f"video frame {index} is {image.width}x{image.height} but frame 0 is "
                    f"{images[0].width}x{images[0].height}; all frames must have one size"
                )
        out = self.processor(images=images, return_tensors="pt")
        _, grid_h, grid_w = (int(v) for v in out["image_grid_thw"][0])
        tps, p, n = self.temporal_patch_size, self.patch_size, grid_h * grid_w
        frames = out["pixel_values"].view(len(images), n, 3, tps, p, p)[:, :, :, 0]  # [T, n, C, p, p]
        if len(images) % tps:
            frames = torch.cat([frames, frames[-1:].expand(tps - len(images) % tps, -1, -1, -1, -1)])
        groups = frames.shape[0] // tps
        pixels = frames.view(groups, tps, n, 3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(groups * n, 3 * tps * p * p)
        return PreparedItem(
            pixels=pixels.contiguous(),
            mm_hash=self.mm_hash(video),
            meta={"grid_thw": [groups, grid_h, grid_w], "frames": len(images)},
            batch_key=(),
        )

    def embed(self, items: Sequence[PreparedItem]) -> list[torch.Tensor]:
        pixels = torch.cat([item.pixels for item in items]).to(self.device, self.dtype)
        grid = torch.tensor([item.meta["grid_thw"] for item in items], device=self.device)
        merged = self.merged(self.tower(pixels, grid_thw=grid))
        return list(torch.split(merged, (grid.prod(-1) // self.merge**2).tolist()))

    def merged(self, output: Any) -> torch.Tensor:
        """The tower's output as the language model consumes it, all items packed."""
        return output.pooler_output


OPTIONS = QwenVLOptions


def build(spec: EncoderSpec, device: torch.device, dtype: torch.dtype) -> QwenVLEncoder:
    return QwenVLEncoder(spec.family, spec.path, spec_options(QwenVLOptions, spec), device, dtype)
