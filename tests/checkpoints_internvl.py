"""A tiny full InternVL checkpoint in transformers' format (``InternVLForConditionalGeneration``,
model_type ``internvl``: InternViT tower, pixel shuffle, MLP projector, Qwen2 language model).

``save_internvl`` saves the weights (sharded) and the image processor config (GOT-OCR2's,
tiling up to ``MAX_TILES`` tiles plus a thumbnail) and returns the in-memory model;
``save_internvl_for_engines`` adds what vLLM's processor for this format reads: a
tokenizer whose ``start_image_token``/``context_image_token``/``end_image_token``/
``video_token`` carry the config's ids, and the processor config (``image_seq_length``).
"""

from __future__ import annotations

import json
import pathlib

from models import _TEXT, _build_and_save

INTERNVL_IMAGE_TOKEN, INTERNVL_START, INTERNVL_END, INTERNVL_VIDEO = 999, 998, 997, 996
INTERNVL_SPECIAL = {"<IMG_CONTEXT>": INTERNVL_IMAGE_TOKEN, "<img>": INTERNVL_START,
                    "</img>": INTERNVL_END, "<video>": INTERNVL_VIDEO}
INTERNVL_TOKEN_ROLES = {"start_image_token": "<img>", "end_image_token": "</img>",
                        "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
INTERNVL_IMAGE = "<IMG_CONTEXT>"  # one image in a prompt (vLLM's placeholder): the processor expands it
# 112 px / 14 px = 8x8 patches per tile, pixel-shuffled (0.5) to 16 tokens (InternVL 3: 448 px, 256 tokens).
SIDE, TOKENS_PER_TILE, MAX_TILES = 112, 16, 4
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               image_size=[SIDE, SIDE], patch_size=[14, 14])


def internvl_processor(**kwargs):
    from transformers.models.got_ocr2 import GotOcr2ImageProcessorPil

    options = dict(size={"height": SIDE, "width": SIDE}, crop_to_patches=True, min_patches=1, max_patches=MAX_TILES)
    return GotOcr2ImageProcessorPil(**{**options, **kwargs})


def save_internvl(path: str, seed: int = 0, lm_head_scale: float = 1.0, text: dict | None = None, **config: object):
    """``config`` overrides the model config's fields (``vision_feature_layer``, ...)."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    fields = dict(image_token_id=INTERNVL_IMAGE_TOKEN, image_seq_length=TOKENS_PER_TILE, downsample_ratio=0.5,
                  vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False)
    config = InternVLConfig(
        vision_config=_VISION,
        text_config=dict(model_type="qwen2", **{**_TEXT, **(text or {})}, tie_word_embeddings=False),
        **{**fields, **config},
    )
    return _build_and_save(InternVLForConditionalGeneration, config, internvl_processor(), path, seed, "200KB",
                           lm_head_scale)


def save_internvl_for_engines(path: str, seed: int = 0, lm_head_scale: float | None = None):
    """``save_internvl`` plus its tokenizer, chat template and processor config; returns the model.
    ``lm_head_scale``: None is the engine tests' ``LM_HEAD_SCALE``."""
    # Imported here: engine_checkpoints lists this module's checkpoint.
    from engine_checkpoints import _BASE, ENGINE_TEXT, LM_HEAD_SCALE, _save_tokenizer

    scale = LM_HEAD_SCALE if lm_head_scale is None else lm_head_scale
    model = save_internvl(path, seed=seed, lm_head_scale=scale, text=ENGINE_TEXT)
    _save_tokenizer(path, model.config.text_config.vocab_size, {**_BASE, **INTERNVL_SPECIAL}, INTERNVL_IMAGE,
                    roles=INTERNVL_TOKEN_ROLES)
    # Written, not saved from an ``InternVLProcessor``: that one wants its video processor,
    # which needs torchvision (vLLM's side builds its own from the image processor's size).
    pathlib.Path(path, "processor_config.json").write_text(
        json.dumps({"processor_class": "InternVLProcessor", "image_seq_length": TOKENS_PER_TILE}, indent=2)
    )
    return model
