"""InternVL (transformers' format): the served embedding of image bytes equals transformers'
own image features for the tiles its processor cuts from the same bytes (no Ray).

transformers' ``InternVLProcessor`` cannot be built in this venv (its video processor needs
torchvision), so the reference calls its image processor with what that processor passes
it, ``crop_to_patches=True`` (pinned below); vLLM's processor for this format calls the same
``InternVLProcessor``, and the engine tests run it.
"""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from checkpoints_internvl import MAX_TILES, TOKENS_PER_TILE, save_internvl
from encoder import EncoderSpec, build_encoder
from encoder.checkpoint import CheckpointError
from models import save_llava
from support import image_bytes, one_thread

# (bytes, tiles): 3:2 -> 2x1 tiles + thumbnail; 1:1 -> one tile, no thumbnail; 4:1 -> 4x1 + thumbnail
IMAGES = [(image_bytes(150, 100, seed=1), 3), (image_bytes(90, 90, seed=2, fmt="JPEG"), 1),
          (image_bytes(400, 100, seed=3), 5)]


@pytest.fixture(scope="module")
def internvl_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("internvl"))
    return path, save_internvl(path)


def _reference(model, path: str, data: bytes, **settings) -> torch.Tensor:
    from transformers.models.got_ocr2 import GotOcr2ImageProcessorPil

    processor = GotOcr2ImageProcessorPil.from_pretrained(path)
    image = Image.open(io.BytesIO(data)).convert("RGB")
    pixels = processor(images=[image], return_tensors="pt", **{"crop_to_patches": True, **settings})["pixel_values"]
    with torch.no_grad():
        return model.get_image_features(pixels).pooler_output.flatten(0, 1)


def test_the_processor_tiles_by_default_as_assumed():
    from transformers import InternVLProcessor

    assert InternVLProcessor.images_kwargs == {"crop_to_patches": True}


def test_embedding_equals_transformers_image_features(internvl_dir):
    from transformers.models.got_ocr2 import GotOcr2ImageProcessorPil

    path, model = internvl_dir
    encoder = build_encoder(EncoderSpec(family="internvl", path=path))
    assert {k.split(".")[0] for k in encoder.loaded_keys} == {"vision_tower", "multi_modal_projector"}
    counter = GotOcr2ImageProcessorPil.from_pretrained(path)
    for data, tiles in IMAGES:
        with one_thread():
            item = encoder.encode_batch([encoder.preprocess(data)])[0]
            reference = _reference(model, path, data)
        width, height = Image.open(io.BytesIO(data)).size
        # The count vLLM's processing info derives the image's token count from.
        assert counter.get_number_of_image_patches(height, width, {"crop_to_patches": True}) == tiles
        assert item.meta["tiles"] == tiles
        assert item.meta["shape"] == [tiles * TOKENS_PER_TILE, model.config.text_config.hidden_size]
        assert torch.equal(item.tensor(), reference)
        assert reference.abs().max() > 0.01  # not vacuous: a real embedding


@pytest.mark.parametrize("options,settings,tiles", [
    ({"crop_to_patches": False}, {"crop_to_patches": False}, 1),
    ({"max_patches": 2}, {"max_patches": 2}, 3),
])
def test_tiling_options_act_as_the_processor_settings_do(internvl_dir, options, settings, tiles):
    path, model = internvl_dir
    encoder = build_encoder(EncoderSpec(family="internvl", path=path, options=options))
    data = IMAGES[2][0]
    with one_thread():
        item = encoder.encode_batch([encoder.preprocess(data)])[0]
        reference = _reference(model, path, data, **settings)
    assert item.meta["tiles"] == tiles and tiles < IMAGES[2][1] <= MAX_TILES + 1
    assert torch.equal(item.tensor(), reference)
    assert encoder.identity != build_encoder(EncoderSpec(family="internvl", path=path)).identity


def test_another_feature_layer_follows_the_config(tmp_path):
    model = save_internvl(str(tmp_path), vision_feature_layer=-2)
    encoder = build_encoder(EncoderSpec(family="internvl", path=str(tmp_path)))
    data = IMAGES[1][0]
    with one_thread():
        ours = encoder.encode_batch([encoder.preprocess(data)])[0].tensor()
        # transformers' forward passes the config's values; get_image_features takes them as arguments.
        pixels = encoder.preprocess(data).pixels
        with torch.no_grad():
            reference = model.get_image_features(pixels, vision_feature_layer=-2,
                                                 vision_feature_select_strategy="default").pooler_output.flatten(0, 1)
            last = model.get_image_features(pixels, vision_feature_layer=-1,
                                            vision_feature_select_strategy="default").pooler_output.flatten(0, 1)
    assert torch.equal(ours, reference) and not torch.equal(ours, last)


def test_a_batch_embeds_like_each_item_alone(internvl_dir):
    encoder = build_encoder(EncoderSpec(family="internvl", path=internvl_dir[0]))
    prepared = [encoder.preprocess(d) for d, _ in IMAGES] + [encoder.preprocess(image_bytes(150, 100, seed=9))]
    with one_thread():
        batched = encoder.encode_batch(prepared)
        alone = [encoder.encode_batch([p])[0] for p in prepared]
    assert [b.meta["tiles"] for b in batched] == [3, 1, 5, 3]  # the two 3-tile items share a pass
    assert all(torch.equal(a.tensor(), b.tensor()) for a, b in zip(batched, alone))


def test_tiny_default_builds_without_a_path():
    encoder = build_encoder(EncoderSpec(family="internvl"))
    item = encoder.encode_batch([encoder.preprocess(IMAGES[1][0])])[0]
    assert item.meta["shape"] == [16, 256]


def test_a_checkpoint_of_another_family_is_refused(tmp_path, internvl_dir):
    save_llava(str(tmp_path))
    with pytest.raises(CheckpointError, match="holds a 'llava' model, not internvl.*set model.family to match it"):
        build_encoder(EncoderSpec(family="internvl", path=str(tmp_path)))
    with pytest.raises(CheckpointError, match="holds a 'internvl' model, not gemma3"):
        build_encoder(EncoderSpec(family="gemma3", path=internvl_dir[0]))
