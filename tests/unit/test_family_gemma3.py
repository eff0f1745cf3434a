"""Gemma 3: the served embedding of image bytes equals transformers' own image features,
with the pixels transformers' ``Gemma3Processor`` makes from the same bytes (no Ray)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from checkpoints_gemma3 import GEMMA3_IMAGE, MM_TOKENS_PER_IMAGE, save_gemma3, save_gemma3_for_engines
from encoder import EncoderSpec, build_encoder
from encoder.checkpoint import CheckpointError
from models import save_llava
from support import image_bytes, one_thread

IMAGES = [image_bytes(150, 100, seed=1), image_bytes(96, 64, seed=2, fmt="JPEG"), image_bytes(300, 200, seed=3)]
WIDE = image_bytes(600, 300, seed=4)  # wide enough for two pan-and-scan crops of at least 256 px


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    """The engine variant: Hub weight layout, tokenizer and processor config."""
    path = str(tmp_path_factory.mktemp("gemma3"))
    return path, save_gemma3_for_engines(path, lm_head_scale=1.0)


def _reference(model, path: str, data: bytes, **processor_kwargs) -> torch.Tensor:
    """transformers end to end: its processor on the decoded bytes, then ``get_image_features``."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path, backend="pil")  # as the service: not torchvision, which a stand-in may shadow
    image = Image.open(io.BytesIO(data)).convert("RGB")
    pixels = processor(text=GEMMA3_IMAGE, images=[image], return_tensors="pt", **processor_kwargs)["pixel_values"]
    with torch.no_grad():
        return model.get_image_features(pixels).pooler_output.flatten(0, 1)


def test_embedding_equals_transformers_image_features(gemma3_dir):
    path, model = gemma3_dir
    encoder = build_encoder(EncoderSpec(family="gemma3", path=path))
    assert {k.split(".")[0] for k in encoder.loaded_keys} == {"vision_tower", "multi_modal_projector"}
    embeddings = []
    for data in IMAGES:
        with one_thread():
            item = encoder.encode_batch([encoder.preprocess(data)])[0]
            reference = _reference(model, path, data)
        assert item.meta["shape"] == [MM_TOKENS_PER_IMAGE, model.config.text_config.hidden_size]
        assert item.meta["tiles"] == 1
        assert torch.equal(item.tensor(), reference)
        embeddings.append(reference)
    assert not torch.equal(embeddings[0], embeddings[1])  # not vacuous: images embed apart


def test_pan_and_scan_crops_follow_the_image_as_vllm_concatenates_them(gemma3_dir):
    path, model = gemma3_dir
    encoder = build_encoder(EncoderSpec(family="gemma3", path=path, options={"pan_and_scan": True}))
    with one_thread():
        item = encoder.encode_batch([encoder.preprocess(WIDE)])[0]
        reference = _reference(model, path, WIDE, do_pan_and_scan=True)
    assert item.meta["tiles"] == 3  # the image and its two crops
    assert item.meta["shape"][0] == 3 * MM_TOKENS_PER_IMAGE
    assert torch.equal(item.tensor(), reference)
    plain = build_encoder(EncoderSpec(family="gemma3", path=path))
    assert plain.preprocess(WIDE).meta["tiles"] == 1  # off unless asked, as in vLLM
    assert plain.identity != encoder.identity


def test_transformers_own_layout_loads_too(tmp_path):
    """``save_pretrained``'s layout (``vision_tower.embeddings.*``), not only the Hub's."""
    model = save_gemma3(str(tmp_path))
    encoder = build_encoder(EncoderSpec(family="gemma3", path=str(tmp_path)))
    prepared = encoder.preprocess(IMAGES[0])
    with one_thread(), torch.no_grad():
        ours = encoder.encode_batch([prepared])[0].tensor()
        reference = model.get_image_features(prepared.pixels).pooler_output[0]
    assert torch.equal(ours, reference)


def test_a_batch_embeds_like_each_item_alone(gemma3_dir):
    encoder = build_encoder(EncoderSpec(family="gemma3", path=gemma3_dir[0], options={"pan_and_scan": True}))
    prepared = [encoder.preprocess(d) for d in [*IMAGES, WIDE]]
    with one_thread():
        batched = encoder.encode_batch(prepared)
        alone = [encoder.encode_batch([p])[0] for p in prepared]
    assert [b.meta["tiles"] for b in batched] == [1, 1, 1, 3]
    assert all(torch.equal(a.tensor(), b.tensor()) for a, b in zip(batched, alone))


def test_tiny_default_builds_without_a_path():
    encoder = build_encoder(EncoderSpec(family="gemma3"))
    item = encoder.encode_batch([encoder.preprocess(IMAGES[0])])[0]
    assert item.meta["shape"] == [16, 256]


def test_a_checkpoint_of_another_family_is_refused(tmp_path):
    save_llava(str(tmp_path))
    with pytest.raises(CheckpointError, match="holds a 'llava' model, not gemma3.*set model.family to match it"):
        build_encoder(EncoderSpec(family="gemma3", path=str(tmp_path)))
    with pytest.raises(ValueError, match="unknown gemma3 options"):
        build_encoder(EncoderSpec(family="gemma3", options={"crop_to_patches": True}))
