"""A tiny full Gemma 3 checkpoint (SigLIP tower, pooling projector, Gemma 3 language model).

``save_gemma3`` saves the weights (sharded) and the image processor config and returns
the in-memory model; ``save_gemma3_for_engines`` adds what vLLM's Gemma 3 processor
reads: a tokenizer whose ``boi_token``/``image_token``/``eoi_token`` carry the config's ids,
the newline tokens its placeholder search looks up (``"\\n"`` to ``"\\n\\n\\n\\n"``), and
the processor config (``image_seq_length``).
"""

from __future__ import annotations

import torch

from models import _TEXT, _build_and_save

GEMMA3_IMAGE_TOKEN, GEMMA3_BOI, GEMMA3_EOI = 999, 998, 997
# The spellings vLLM's and transformers' Gemma 3 processors look up, with this model's ids.
GEMMA3_SPECIAL = {
    "<start_of_image>": GEMMA3_BOI, "<end_of_image>": GEMMA3_EOI, "<image_soft_token>": GEMMA3_IMAGE_TOKEN,
    "\n": 990, "\n\n": 991, "\n\n\n": 992, "\n\n\n\n": 993,
}
GEMMA3_TOKEN_ROLES = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                      "image_token": "<image_soft_token>"}
GEMMA3_IMAGE = "<start_of_image>"  # one image in a prompt: the processor expands it
# 112 px / 14 px = 8x8 patches, pooled 2x2 to 16 tokens per image (Gemma 3: 896 px, 64x64 -> 256).
# No pooling head (``vision_use_head``), as in Gemma 3's own config: the projector pools.
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=112,
               patch_size=14, vision_use_head=False)
MM_TOKENS_PER_IMAGE = 16


def gemma3_processor(**kwargs):
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": _VISION["image_size"], "width": _VISION["image_size"]}, **kwargs)


def save_gemma3(path: str, seed: int = 0, lm_head_scale: float = 1.0, text: dict | None = None):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {**_TEXT, **(text or {})}
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    config = Gemma3Config(
        # Gemma 3 defaults to 256-wide heads and a tied LM head; an engine test scales an untied one.
        text_config=dict(**text, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=64,
                         layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False),
        vision_config=_VISION, mm_tokens_per_image=MM_TOKENS_PER_IMAGE,
        image_token_index=GEMMA3_IMAGE_TOKEN, boi_token_index=GEMMA3_BOI, eoi_token_index=GEMMA3_EOI,
        tie_word_embeddings=False,
    )

    def with_projection(config):
        # transformers initialises the projection to zeros (training fills it): every image
        # would embed to 0, and no test could tell one image, or a wrong embedding, from another.
        model = Gemma3ForConditionalGeneration(config)
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.1)
        return model

    return _build_and_save(with_projection, config, gemma3_processor(), path, seed, "200KB", lm_head_scale)


def save_gemma3_for_engines(path: str, seed: int = 0, lm_head_scale: float | None = None):
    """``save_gemma3`` plus its tokenizer, chat template and processor config; returns the model.
    ``lm_head_scale``: None is the engine tests' ``LM_HEAD_SCALE``."""
    from transformers import Gemma3Processor

    # Imported here: engine_checkpoints lists this module's checkpoint.
    from engine_checkpoints import _BASE, ENGINE_TEXT, LM_HEAD_SCALE, _hub_llava_layout, _save_tokenizer

    scale = LM_HEAD_SCALE if lm_head_scale is None else lm_head_scale
    model = save_gemma3(path, seed=seed, lm_head_scale=scale, text=ENGINE_TEXT)
    tokenizer = _save_tokenizer(path, model.config.text_config.vocab_size, {**_BASE, **GEMMA3_SPECIAL}, GEMMA3_IMAGE,
                                roles=GEMMA3_TOKEN_ROLES)
    Gemma3Processor(image_processor=gemma3_processor(), tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                    image_seq_length=MM_TOKENS_PER_IMAGE).save_pretrained(path)
    _hub_llava_layout(path)  # vLLM's SigLIP wants vision_tower.vision_model.*, as Gemma 3 on the Hub has it
    return model
