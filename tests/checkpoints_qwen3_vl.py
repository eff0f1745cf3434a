"""Tiny full Qwen3-VL and Qwen3.5 checkpoints (transformers, seeded), and their engine variants.

``save_qwen3_vl`` and ``save_qwen3_5`` build the full model from a small config, save it
in several safetensors shards with Qwen3-VL's image processor settings (patch 16,
mean = std = 0.5), and return the in-memory model, like ``models.save_*``. The
``*_for_engines`` variants add the tokenizer and chat template an engine needs: the
Qwen spellings of the vision tokens, which vLLM's Qwen3-VL processor looks up.

Qwen3-VL's tower here has two DeepStack levels (layers 0 and 1), so the staged width
is three times ``out_hidden_size`` and the order of the levels matters; Qwen3.5's has
none. Qwen3.5's language model mixes a Gated DeltaNet layer and a full-attention layer,
as the released models do (three to one).
"""

from __future__ import annotations

import torch

from models import _TEXT, QWEN_IMAGE_TOKEN, QWEN_VIDEO_TOKEN, QWEN_VISION_END, QWEN_VISION_START, _build_and_save

# A random tiny Qwen3.5's greedy tokens still had near-ties with the LM head scaled alone;
# larger token embeddings (x4) separated them.
QWEN3_5_EMBED_SCALE = 4.0
_TOKENS = dict(image_token_id=QWEN_IMAGE_TOKEN, video_token_id=QWEN_VIDEO_TOKEN,
               vision_start_token_id=QWEN_VISION_START, vision_end_token_id=QWEN_VISION_END)


def _vision(out_hidden_size: int, **extra) -> dict:
    # 64 learned positions: an 8x8 grid, bilinearly resampled to each image's patch grid.
    return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=out_hidden_size,
                patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, **extra)


def _processor():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=64 * 64, max_pixels=256 * 256, patch_size=16, merge_size=2,
                                    temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def _rope(rotary_dim: int) -> dict:
    """Interleaved M-RoPE over ``rotary_dim`` (time, height, width), in the released 24:20:20 proportion."""
    half = rotary_dim // 2
    hw = 5 * half // 16
    return dict(rope_type="default", rope_theta=10000.0, mrope_section=[half - 2 * hw, hw, hw], mrope_interleaved=True)


def _text(text: dict | None) -> dict:
    text = {**_TEXT, **(text or {})}
    return dict(text, head_dim=text["hidden_size"] // text["num_attention_heads"])


def _scaled_embeddings(model_cls, scale: float):
    """``model_cls`` whose token embeddings are multiplied by ``scale`` right after the seeded init."""

    def build(config):
        model = model_cls(config)
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(scale)
        return model

    return build


def save_qwen3_vl(path: str, seed: int = 0, lm_head_scale: float = 1.0, text: dict | None = None):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = _text(text)
    config = Qwen3VLConfig(
        text_config=dict(text, rope_parameters=_rope(text["head_dim"])),
        vision_config=_vision(text["hidden_size"], deepstack_visual_indexes=[0, 1]), **_TOKENS,
    )
    return _build_and_save(Qwen3VLForConditionalGeneration, config, _processor(), path, seed, "200KB", lm_head_scale)


def save_qwen3_5(path: str, seed: int = 0, lm_head_scale: float = 1.0, text: dict | None = None,
                 embed_scale: float = 1.0):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = _text(text)
    # Qwen3.5 rotates a quarter of each head (partial_rotary_factor), and each of M-RoPE's
    # three sections needs at least one pair of it: heads of 32 or more.
    text["head_dim"] = max(text["head_dim"], 32)
    rotary = text["head_dim"] // 4
    # Linear-attention heads of 128, the released size: vLLM's CPU Gated DeltaNet kernel
    # refused 32 ("Unexpected head dim size, 32").
    config = Qwen3_5Config(
        text_config=dict(text, rope_parameters=dict(_rope(rotary), partial_rotary_factor=0.25),
                         layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                         linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1,
                         linear_num_value_heads=2),
        vision_config=_vision(text["hidden_size"]), **_TOKENS,
    )
    model_cls = _scaled_embeddings(Qwen3_5ForConditionalGeneration, embed_scale)
    return _build_and_save(model_cls, config, _processor(), path, seed, "200KB", lm_head_scale)


def save_qwen3_vl_for_engines(path: str, seed: int = 0, lm_head_scale: float | None = None):
    """``save_qwen3_vl`` with an engine's head sizes, plus its tokenizer and chat template."""
    return _for_engines(save_qwen3_vl, path, seed, lm_head_scale)


def save_qwen3_5_for_engines(path: str, seed: int = 0, lm_head_scale: float | None = None):
    """``save_qwen3_5`` with an engine's head sizes, plus its tokenizer and chat template."""
    return _for_engines(save_qwen3_5, path, seed, lm_head_scale, embed_scale=QWEN3_5_EMBED_SCALE)


def _for_engines(save, path: str, seed: int, lm_head_scale: float | None, **extra):
    # engine_checkpoints imports this module for its table: read it only when called.
    from engine_checkpoints import ENGINE_TEXT, LM_HEAD_SCALE, QWEN_IMAGE, QWEN_SPECIAL, _save_tokenizer

    scale = LM_HEAD_SCALE if lm_head_scale is None else lm_head_scale
    model = save(path, seed=seed, lm_head_scale=scale, text=ENGINE_TEXT, **extra)
    _save_tokenizer(path, model.config.text_config.vocab_size, QWEN_SPECIAL, QWEN_IMAGE)
    return model
