"""Real vision towers from transformers: tiny defaults, checkpoint loading, equivalence (no Ray)."""

import json
import os

import numpy as np
import pytest
import torch

from encoder import EncoderSpec, Video, build_encoder
from encoder.checkpoint import CheckpointError
from models import (
    llava_logits_from_embeddings,
    llava_prompt,
    qwen_logits_from_embeddings,
    qwen_prompt,
    qwen_video_reference_pixels,
    save_llava,
    save_qwen2_5_vl,
    save_qwen2_vl,
)
from support import image_bytes, one_thread

IMAGES = [image_bytes(150, 100, seed=1), image_bytes(96, 64, seed=2), image_bytes(300, 200, seed=3)]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2_5_vl"))
    return path, save_qwen2_5_vl(path)


@pytest.fixture(scope="module", params=["clip", "siglip"])
def llava_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"llava_{request.param}"))
    return path, save_llava(path, vision=request.param)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "llava"])
def test_tiny_default_of_each_family_batches_like_alone(family):
    encoder = build_encoder(EncoderSpec(family=family))
    prepared = [encoder.preprocess(d) for d in IMAGES]
    with one_thread():
        batched = encoder.encode_batch(prepared)
        alone = [encoder.encode_batch([p])[0] for p in prepared]
    assert all(np.array_equal(a.payload, b.payload) for a, b in zip(batched, alone))
    # With several intra-op threads the BLAS splits rows by batch size, and the
    # last bits may move (7e-8 seen for Qwen packing on 2 threads).
    threaded = encoder.encode_batch(prepared)
    for a, b in zip(threaded, alone):
        torch.testing.assert_close(a.tensor(), b.tensor(), rtol=0, atol=1e-6)
    assert all(item.meta["shape"][1] == 256 for item in batched)  # the tiny LM hidden size
    with one_thread():
        again = build_encoder(EncoderSpec(family=family)).encode_batch(prepared[:1])[0]
    assert np.array_equal(again.payload, alone[0].payload)  # seeded: the same weights in every process


def test_qwen_tokens_follow_image_size_and_carry_grid_thw():
    encoder = build_encoder(EncoderSpec(family="qwen2_5_vl"))
    items = encoder.encode_batch([encoder.preprocess(d) for d in IMAGES])
    for item in items:
        t, h, w = item.meta["grid_thw"]
        assert item.meta["shape"][0] == t * h * w // 4
    assert len({item.meta["shape"][0] for item in items}) == 3


def test_sharded_full_qwen_checkpoint_reads_only_vision_weights(qwen_dir):
    path, model = qwen_dir
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        keys = set(json.load(f)["weight_map"])
    assert len({f for f in os.listdir(path) if f.endswith(".safetensors")}) > 1  # really sharded
    vision_keys = {k for k in keys if k.startswith("visual.")}
    encoder = build_encoder(EncoderSpec(family="qwen2_5_vl", path=path))
    assert set(encoder.loaded_keys) == vision_keys
    assert not any(k.startswith(("model.", "lm_head")) for k in encoder.loaded_keys)
    ours = encoder.encode_batch([encoder.preprocess(IMAGES[0])])[0].tensor()
    with torch.no_grad():
        pixels = encoder.preprocess(IMAGES[0])
        reference = model.get_image_features(pixels.pixels, torch.tensor([pixels.meta["grid_thw"]])).pooler_output[0]
    assert torch.equal(ours, reference)


def test_qwen_logits_from_served_embeddings_equal_monolithic(qwen_dir):
    path, model = qwen_dir
    encoder = build_encoder(EncoderSpec(family="qwen2_5_vl", path=path))
    prepared = [encoder.preprocess(d) for d in IMAGES[:2]]
    embeddings = [item.tensor() for item in encoder.encode_batch(prepared)]
    grid = torch.tensor([p.meta["grid_thw"] for p in prepared])
    input_ids = qwen_prompt([e.shape[0] for e in embeddings])
    with torch.no_grad():
        monolithic = model(
            input_ids=input_ids, pixel_values=torch.cat([p.pixels for p in prepared]), image_grid_thw=grid,
            mm_token_type_ids=(input_ids == 999).int(),
        ).logits
        disaggregated = qwen_logits_from_embeddings(model, input_ids, embeddings, grid)
    assert torch.equal(monolithic, disaggregated)


def test_vision_only_qwen_directory_loads(qwen_dir, tmp_path):
    _, model = qwen_dir
    model.model.visual.save_pretrained(tmp_path)
    encoder = build_encoder(EncoderSpec(family="qwen2_5_vl", path=str(tmp_path)))
    assert encoder.loaded_keys and not any(k.startswith("visual.") for k in encoder.loaded_keys)
    full = build_encoder(EncoderSpec(family="qwen2_5_vl", path=qwen_dir[0]))
    prepared = full.preprocess(IMAGES[0])
    assert torch.equal(encoder.encode_batch([prepared])[0].tensor(), full.encode_batch([prepared])[0].tensor())


def test_llava_reads_only_tower_and_projector_and_matches_monolithic(llava_dir):
    path, model = llava_dir
    encoder = build_encoder(EncoderSpec(family="llava", path=path))
    assert {k.split(".")[0] for k in encoder.loaded_keys} == {"vision_tower", "multi_modal_projector"}
    prepared = [encoder.preprocess(d) for d in IMAGES[:2]]
    embeddings = [item.tensor() for item in encoder.encode_batch(prepared)]
    pixels = torch.stack([p.pixels for p in prepared])
    input_ids = llava_prompt([e.shape[0] for e in embeddings])
    with torch.no_grad():
        reference = model.get_image_features(pixels, vision_feature_layer=-2,
                                             vision_feature_select_strategy=model.config.vision_feature_select_strategy)
        monolithic = model(input_ids=input_ids, pixel_values=pixels).logits
        disaggregated = llava_logits_from_embeddings(model, input_ids, embeddings)
    assert all(torch.equal(a, b) for a, b in zip(embeddings, reference.pooler_output))
    assert torch.equal(monolithic, disaggregated)


def test_vision_only_clip_directory_loads(tmp_path):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    tower = CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=56, patch_size=14))
    tower.save_pretrained(tmp_path)
    encoder = build_encoder(EncoderSpec(family="clip", path=str(tmp_path)))
    item = encoder.encode_batch([encoder.preprocess(IMAGES[0])])[0]
    assert item.meta["shape"] == [17, 32]  # 4x4 patches + CLS, last layer, no projector


@pytest.mark.parametrize(
    "spec,message",
    [
        (dict(family="llava", path="/nonexistent/model"), "is not a directory"),
        (dict(family="clip"), "needs model.path"),
        (dict(family="qwen2_5_vl", options={"min_pixel": 1}), "unknown qwen2_5_vl options"),
    ],
)
def test_bad_model_specs_say_what_to_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        build_encoder(EncoderSpec(**spec))


def test_family_that_does_not_match_the_checkpoint_is_refused(qwen_dir):
    with pytest.raises(CheckpointError, match="set model.family to match it"):
        build_encoder(EncoderSpec(family="llava", path=qwen_dir[0]))


def test_directory_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl_vision"}))
    with pytest.raises(CheckpointError, match="only safetensors"):
        build_encoder(EncoderSpec(family="qwen2_5_vl", path=str(tmp_path)))


def _pil(data):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_video_frames_are_laid_out_like_qwens_video_processor(count):
    encoder = build_encoder(EncoderSpec(family="qwen2_5_vl"))
    frames = [image_bytes(150, 100, seed=s) for s in range(count)]
    prepared = encoder.prepare(Video(tuple(frames)))
    reference, grid = qwen_video_reference_pixels(encoder.processor, [_pil(f) for f in frames])
    assert prepared.meta["grid_thw"] == grid and prepared.meta["frames"] == count
    assert torch.equal(prepared.pixels, reference)


def test_two_identical_frames_embed_like_the_image():
    encoder = build_encoder(EncoderSpec(family="qwen2_5_vl"))
    with one_thread():
        image = encoder.encode_batch([encoder.prepare(IMAGES[0])])[0]
        video = encoder.encode_batch([encoder.prepare(Video((IMAGES[0], IMAGES[0])))])[0]
    assert torch.equal(image.tensor(), video.tensor()) and image.meta["mm_hash"] != video.meta["mm_hash"]


@pytest.mark.parametrize(
    "family,frames,message",
    [
        ("qwen2_5_vl", (IMAGES[0], IMAGES[1]), "frame 1 is 96x64 but frame 0 is 150x100"),
        ("qwen2_5_vl", (IMAGES[0], b"not an image"), "not an image"),
        ("llava", (IMAGES[0],), "takes images only"),
        ("tiny-vit", (IMAGES[0],), "takes images only"),
    ],
)
def test_bad_videos_are_refused(family, frames, message):
    from encoder import MediaError

    with pytest.raises(MediaError, match=message):
        build_encoder(EncoderSpec(family=family)).prepare(Video(frames))


def test_qwen2_vl_checkpoint_loads_vision_only_and_matches_the_model(tmp_path):
    model = save_qwen2_vl(str(tmp_path))
    encoder = build_encoder(EncoderSpec(family="qwen2_vl", path=str(tmp_path)))
    assert encoder.loaded_keys and all(k.startswith("visual.") for k in encoder.loaded_keys)
    prepared = encoder.preprocess(IMAGES[0])
    with torch.no_grad():
        reference = model.get_image_features(prepared.pixels, torch.tensor([prepared.meta["grid_thw"]])).pooler_output[0]
    assert torch.equal(encoder.encode_batch([prepared])[0].tensor(), reference)
