"""Tiny real multimodal models (transformers, built from small configs, seeded), saved as checkpoints.

Each ``save_*`` builds the full model (vision tower, projector or merger, and a
language model), saves it with ``save_pretrained`` in several safetensors
shards plus its image processor config, and returns the in-memory model, so a
test can compare what the service computes from the directory with what the
monolithic model computes.
"""

from __future__ import annotations

import torch

QWEN_IMAGE_TOKEN, QWEN_VIDEO_TOKEN, QWEN_VISION_START, QWEN_VISION_END = 999, 998, 997, 996
LLAVA_IMAGE_TOKEN = 999
_TEXT = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _build_and_save(model_cls, config, processor, path: str, seed: int, max_shard_size: str, lm_head_scale: float = 1.0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config).eval()
    if lm_head_scale != 1.0:  # logits spread apart: no near-ties for greedy decoding (engine_checkpoints.py)
        head = model.get_output_embeddings()
        if head.weight is model.get_input_embeddings().weight:
            raise AssertionError("the LM head is tied to the embeddings: scaling it would scale them too")
        with torch.no_grad():
            head.weight.mul_(lm_head_scale)
    model.save_pretrained(path, max_shard_size=max_shard_size)  # small shards: the checkpoint is really sharded
    processor.save_pretrained(path)
    return model


def _qwen_processor():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=224 * 224, patch_size=14, merge_size=2, temporal_patch_size=2
    )


def _mrope_section(text: dict) -> list[int]:
    """M-RoPE's (temporal, height, width) split of half a head, in Qwen2-VL's 2:3:3 proportion."""
    half = text["hidden_size"] // text["num_attention_heads"] // 2
    return [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]


def save_qwen2_5_vl(path: str, seed: int = 0, lm_head_scale: float = 1.0, text: dict | None = None):
    """``text`` overrides the language model's sizes (an engine's kernels want larger heads)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {**_TEXT, **(text or {})}
    config = Qwen2_5_VLConfig(
        text_config=dict(**text, rope_scaling={"type": "mrope", "mrope_section": _mrope_section(text)}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=QWEN_IMAGE_TOKEN, video_token_id=QWEN_VIDEO_TOKEN,
        vision_start_token_id=QWEN_VISION_START, vision_end_token_id=QWEN_VISION_END,
    )
    return _build_and_save(Qwen2_5_VLForConditionalGeneration, config, _qwen_processor(), path, seed, "200KB", lm_head_scale)


def save_llava(path: str, vision: str = "clip", seed: int = 0, lm_head_scale: float = 1.0, text: dict | None = None):
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig
    from transformers.models.clip import CLIPImageProcessorPil
    from transformers.models.siglip import SiglipImageProcessorPil

    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14)
    if vision == "clip":
        vision_config, strategy = CLIPVisionConfig(**tower), "default"
        processor = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    else:
        vision_config, strategy = SiglipVisionConfig(**tower), "full"
        processor = SiglipImageProcessorPil(size={"height": 56, "width": 56})
    config = LlavaConfig(
        vision_config=vision_config.to_dict(), text_config=dict(model_type="llama", **{**_TEXT, **(text or {})}),
        image_token_id=LLAVA_IMAGE_TOKEN, vision_feature_layer=-2, vision_feature_select_strategy=strategy,
    )
    return _build_and_save(LlavaForConditionalGeneration, config, processor, path, seed, "100KB", lm_head_scale)


def qwen_prompt(token_counts: list[int]) -> torch.Tensor:
    """Input ids with one vision block per image: text, <start>, image tokens, <end>, text."""
    ids = [3, 4, 5]
    for count in token_counts:
        ids += [QWEN_VISION_START] + [QWEN_IMAGE_TOKEN] * count + [QWEN_VISION_END, 6, 7]
    return torch.tensor([ids])


def qwen_logits_from_embeddings(model, input_ids: torch.Tensor, embeddings: list[torch.Tensor], grid_thw: torch.Tensor):
    """What a disaggregated prefill does: fill the image placeholders with received
    embeddings, take M-RoPE positions from grid_thw, run the language model."""
    image_mask = input_ids == QWEN_IMAGE_TOKEN
    mm_token_type_ids = image_mask.int()
    inputs_embeds = model.get_input_embeddings()(input_ids)
    inputs_embeds = inputs_embeds.masked_scatter(image_mask.unsqueeze(-1), torch.cat(embeddings).to(inputs_embeds.dtype))
    position_ids, _ = model.model.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=grid_thw)
    return model(inputs_embeds=inputs_embeds, position_ids=position_ids, mm_token_type_ids=mm_token_type_ids,
                 image_grid_thw=grid_thw).logits


def llava_prompt(token_counts: list[int]) -> torch.Tensor:
    ids = [3, 4]
    for count in token_counts:
        ids += [LLAVA_IMAGE_TOKEN] * count + [5, 6]
    return torch.tensor([ids])


def llava_logits_from_embeddings(model, input_ids: torch.Tensor, embeddings: list[torch.Tensor]):
    image_mask = input_ids == LLAVA_IMAGE_TOKEN
    inputs_embeds = model.get_input_embeddings()(input_ids)
    inputs_embeds = inputs_embeds.masked_scatter(image_mask.unsqueeze(-1), torch.cat(embeddings).to(inputs_embeds.dtype))
    return model(inputs_embeds=inputs_embeds).logits


def qwen_video_reference_pixels(processor, frames) -> tuple[torch.Tensor, list[int]]:
    """Video patches as transformers' Qwen2-VL *video* processor lays them out (its
    ``_patchify``, written out here because that module imports torchvision), from
    the frames the image processor resized and normalised. -> (pixels, grid_thw)."""
    out = processor(images=frames, return_tensors="pt")
    _, grid_h, grid_w = (int(v) for v in out["image_grid_thw"][0])
    p, m, tps, count = processor.patch_size, processor.merge_size, processor.temporal_patch_size, len(frames)
    # Undo the image processor's patchify: (gh/m, gw/m, m, m, C, tps, p, p) -> (C, H, W) per frame.
    per_frame = out["pixel_values"].view(count, grid_h // m, grid_w // m, m, m, 3, tps, p, p)[:, :, :, :, :, :, 0]
    videos = per_frame.permute(0, 5, 1, 3, 6, 2, 4, 7).reshape(1, count, 3, grid_h * p, grid_w * p)
    if pad := -count % tps:
        videos = torch.cat((videos, videos[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
    grid_t = videos.shape[1] // tps
    patches = videos.view(1, grid_t, tps, 3, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(grid_t * grid_h * grid_w, 3 * tps * p * p), [grid_t, grid_h, grid_w]


def save_qwen2_vl(path: str, seed: int = 0):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(**_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=QWEN_IMAGE_TOKEN, video_token_id=QWEN_VIDEO_TOKEN,
        vision_start_token_id=QWEN_VISION_START, vision_end_token_id=QWEN_VISION_END,
    )
    return _build_and_save(Qwen2VLForConditionalGeneration, config, _qwen_processor(), path, seed, "200KB")
