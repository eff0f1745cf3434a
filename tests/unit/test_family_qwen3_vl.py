"""The ``qwen3_vl`` family against transformers' own Qwen3-VL and Qwen3.5 (no Ray).

What is staged per image must be what vLLM's Qwen3-VL keeps in its encoder cache: the
merger's output with the DeepStack levels concatenated on the hidden axis. The reference
here is transformers' ``get_image_features`` on the processor's pixels for the same bytes,
arranged that way; one intra-op thread, float32, compared bitwise.
"""

import json
import os

import pytest
import torch

from checkpoints_qwen3_vl import save_qwen3_5, save_qwen3_vl
from encoder import EncoderSpec, MediaError, Video, build_encoder
from encoder.checkpoint import CheckpointError
from models import QWEN_IMAGE_TOKEN, qwen_prompt, save_qwen2_5_vl
from support import image_bytes, one_thread

IMAGES = [image_bytes(150, 100, seed=1), image_bytes(96, 64, seed=2, fmt="JPEG"), image_bytes(300, 200, seed=3)]
SAVERS = {"qwen3_vl": save_qwen3_vl, "qwen3_5": save_qwen3_5}


@pytest.fixture(scope="module", params=sorted(SAVERS))
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    return path, SAVERS[request.param](path)


def _pil(data):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def _levels(model) -> int:
    return len(getattr(model.config.vision_config, "deepstack_visual_indexes", None) or ())


def _reference(model, path, images):
    """transformers' processor and ``get_image_features`` on ``images``, laid out as vLLM caches
    each item: [main | level 0 | level 1 ...]; -> (per-image tensors, pixels, grid)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(path, backend="pil")  # as the service: not torchvision, which a stand-in may shadow
    inputs = processor(images=[_pil(d) for d in images], return_tensors="pt")
    with torch.no_grad():
        out = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    levels = getattr(out, "deepstack_features", None) or []
    per_image = [torch.cat([main, *(level[i] for level in levels)], dim=-1) for i, main in enumerate(out.pooler_output)]
    return per_image, inputs["pixel_values"], inputs["image_grid_thw"]


def test_full_checkpoint_reads_only_vision_weights(checkpoint):
    path, _ = checkpoint
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        keys = set(json.load(f)["weight_map"])
    assert len(set(os.listdir(path)) - {"model.safetensors.index.json"}) > 3  # really sharded
    encoder = build_encoder(EncoderSpec(family="qwen3_vl", path=path))
    assert set(encoder.loaded_keys) == {k for k in keys if ".visual." in f".{k}"}


def test_staged_embedding_is_transformers_features_with_deepstack_levels(checkpoint):
    path, model = checkpoint
    encoder = build_encoder(EncoderSpec(family="qwen3_vl", path=path, dtype="float32"))
    prepared = [encoder.preprocess(d) for d in IMAGES]
    with one_thread():
        items = encoder.encode_batch(prepared)
        reference, pixels, grid = _reference(model, path, IMAGES)
    assert torch.equal(torch.cat([p.pixels for p in prepared]), pixels)
    assert [p.meta["grid_thw"] for p in prepared] == grid.tolist()
    vision = model.config.vision_config
    for item, want in zip(items, reference, strict=True):
        t, h, w = item.meta["grid_thw"]
        assert item.meta["shape"] == [t * h * w // 4, vision.out_hidden_size * (1 + _levels(model))]
        assert torch.equal(item.tensor(), want)


def test_language_model_on_the_staged_items_gives_the_monolithic_logits(checkpoint):
    """Split back into main and levels, the staged items drive the language model exactly as
    its own vision tower does (the DeepStack levels reach the first decoder layers)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    path, model = checkpoint
    encoder = build_encoder(EncoderSpec(family="qwen3_vl", path=path, dtype="float32"))
    prepared = [encoder.preprocess(d) for d in IMAGES[:2]]
    width = model.config.vision_config.out_hidden_size
    with one_thread():
        staged = [item.tensor() for item in encoder.encode_batch(prepared)]
        pixels, grid = torch.cat([p.pixels for p in prepared]), torch.tensor([p.meta["grid_thw"] for p in prepared])
        input_ids = qwen_prompt([s.shape[0] for s in staged])
        types = (input_ids == QWEN_IMAGE_TOKEN).int()
        parts = [s.split(width, dim=-1) for s in staged]  # per image: (main, level 0, ...)
        outputs = BaseModelOutputWithDeepstackFeatures(
            pooler_output=[p[0] for p in parts], deepstack_features=[[p[1 + k] for p in parts] for k in range(_levels(model))]
        )
        with torch.no_grad():
            monolithic = model(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=types).logits
            served = model(input_ids=input_ids, image_grid_thw=grid, mm_token_type_ids=types,
                           mm_encoder_outputs={"image": outputs}).logits
    assert torch.equal(monolithic, served)


def test_vision_only_directory_loads(checkpoint, tmp_path):
    path, model = checkpoint
    model.model.visual.save_pretrained(tmp_path)
    alone = build_encoder(EncoderSpec(family="qwen3_vl", path=str(tmp_path)))
    full = build_encoder(EncoderSpec(family="qwen3_vl", path=path))
    prepared = full.preprocess(IMAGES[0])
    with one_thread():
        assert torch.equal(alone.encode_batch([prepared])[0].tensor(), full.encode_batch([prepared])[0].tensor())


def test_tiny_default_has_a_deepstack_level():
    encoder = build_encoder(EncoderSpec(family="qwen3_vl"))
    item = encoder.encode_batch([encoder.preprocess(IMAGES[0])])[0]
    assert item.meta["shape"][1] == 256 * 2 and encoder.processor.patch_size == 16


def test_videos_are_refused_with_the_reason():
    with pytest.raises(MediaError, match="per-frame timestamps"):
        build_encoder(EncoderSpec(family="qwen3_vl")).prepare(Video((IMAGES[0], IMAGES[0])))


def test_checkpoint_of_another_family_is_refused(checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="not qwen2_5_vl; set model.family to match it"):
        build_encoder(EncoderSpec(family="qwen2_5_vl", path=checkpoint[0]))
    save_qwen2_5_vl(str(tmp_path))
    with pytest.raises(CheckpointError, match="'qwen2_5_vl' model, not qwen3_vl; set model.family to match it"):
        build_encoder(EncoderSpec(family="qwen3_vl", path=str(tmp_path)))
