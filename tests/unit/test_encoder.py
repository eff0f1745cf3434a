"""The tiny-vit model, preprocessing, and the tensor <-> payload codec (no Ray)."""

import numpy as np
import pytest
import torch

from encoder import EncoderSpec, MediaError, MediaPolicy, build_encoder, item_media, payload_to_tensor, tensor_to_payload
from encoder.tiny_vit import TinyViTConfig, target_size
from support import data_url, image_bytes


@pytest.fixture(scope="module")
def enc():
    return build_encoder(EncoderSpec(family="tiny-vit"))


def test_tokens_follow_image_size(enc):
    small = enc.encode_batch([enc.preprocess(image_bytes(64, 64))])[0]
    wide = enc.encode_batch([enc.preprocess(image_bytes(320, 160))])[0]
    assert small.meta["shape"] == [16, 512] and small.meta["grid"] == [4, 4]
    assert wide.meta["shape"] == [200, 512] and wide.meta["grid"] == [10, 20]
    assert small.meta["nbytes"] == 16 * 512 * 4 and small.meta["dtype"] == "float32"


def test_resize_respects_pixel_budget():
    cfg = TinyViTConfig()
    h, w = target_size(4000, 3000, cfg)
    assert h % 16 == 0 and w % 16 == 0 and h * w <= cfg.max_pixels
    h, w = target_size(16, 16, cfg)
    assert h * w >= cfg.min_pixels


def test_same_seed_same_weights_and_batching_does_not_change_results(enc):
    data = [image_bytes(224, 224, seed=s) for s in range(3)] + [image_bytes(96, 64, seed=9)]
    prepared = [enc.preprocess(d) for d in data]
    batched = enc.encode_batch(prepared)
    other = build_encoder(EncoderSpec(family="tiny-vit"))
    alone = [other.encode_batch([p])[0] for p in prepared]
    for a, b in zip(batched, alone):
        assert np.array_equal(a.payload, b.payload)
    reseeded = build_encoder(EncoderSpec(family="tiny-vit", options={"seed": 1}))
    assert not np.array_equal(reseeded.encode_batch([prepared[0]])[0].payload, alone[0].payload)


def test_mm_hash_depends_on_bytes_and_model(enc):
    a, b = image_bytes(64, 64, seed=1), image_bytes(64, 64, seed=2)
    assert enc.preprocess(a).mm_hash == enc.preprocess(a).mm_hash
    assert enc.preprocess(a).mm_hash != enc.preprocess(b).mm_hash
    other = build_encoder(EncoderSpec(family="tiny-vit", options={"seed": 3}))
    assert other.preprocess(a).mm_hash != enc.preprocess(a).mm_hash


def test_registry_side_mm_hash_from_the_callers_digest_equals_the_encoders(enc):
    from encoder import Video, media_digest, mm_hash

    a = image_bytes(64, 64, seed=1)
    assert mm_hash(media_digest(a), enc.identity) == enc.preprocess(a).mm_hash
    # Frame boundaries count: the same bytes split differently are another video.
    assert media_digest(Video((b"ab", b"c"))) != media_digest(Video((b"a", b"bc")))
    assert media_digest(Video((a,))) != media_digest(a)


def test_bfloat16_payload_roundtrip_is_exact_and_zero_copy():
    enc16 = build_encoder(EncoderSpec(family="tiny-vit", dtype="bfloat16"))
    item = enc16.encode_batch([enc16.preprocess(image_bytes(64, 48))])[0]
    assert item.meta["dtype"] == "bfloat16" and item.payload.dtype == np.int16
    tensor = item.tensor()
    assert tensor.dtype == torch.bfloat16 and tensor.data_ptr() == item.payload.ctypes.data
    assert torch.equal(payload_to_tensor(tensor_to_payload(tensor), "bfloat16"), tensor)


def test_read_only_payload_views_without_copy_or_warning(recwarn):
    array = np.arange(12, dtype=np.float32)
    array.flags.writeable = False
    tensor = payload_to_tensor(array, "float32")
    # Only torch's warning about this array counts; any other warning raised meanwhile (an
    # earlier test's object finalized by the collector, say) is not this call's.
    not_writable = [str(w.message) for w in recwarn if "not writable" in str(w.message)]
    assert tensor.data_ptr() == array.ctypes.data and not not_writable
    with pytest.raises(ValueError, match="does not carry bfloat16"):
        payload_to_tensor(array, "bfloat16")


def test_item_media_accepts_data_uri_and_base64():
    png = image_bytes(32, 32)
    policy = MediaPolicy(max_item_bytes=10**6)
    assert item_media({"type": "image_url", "image_url": {"url": data_url(png)}}, policy) == png
    assert item_media({"type": "image", "image": data_url(png).split(",", 1)[1]}, policy) == png


@pytest.mark.parametrize(
    "item,message",
    [
        ({"type": "audio"}, "unsupported item type"),
        ({"type": "video", "video": []}, "non-empty list of frame URLs"),
        ({"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.png"}}, "remote media fetching is off"),
        ({"type": "image_url", "image_url": {"url": "/etc/passwd"}}, "local media files are off"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,abc"}}, "must be base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
        ({"type": "image", "image": ""}, "needs"),
        ({"type": "image", "image": "QUJD" * 100}, "more than the limit of 100 bytes"),
    ],
)
def test_item_media_refuses_with_a_reason(item, message):
    with pytest.raises(MediaError, match=message):
        item_media(item, MediaPolicy(max_item_bytes=100))


@pytest.mark.parametrize(
    "data,message",
    [
        (b"not an image at all", "not an image in a supported format"),
        (image_bytes(64, 64)[:200], "corrupt or truncated"),
        (image_bytes(8, 64), "at least 16 pixels"),
        (image_bytes(64, 64, fmt="PPM"), "format PPM is not supported"),
    ],
)
def test_preprocess_refuses_bad_images(enc, data, message):
    with pytest.raises(MediaError, match=message):
        enc.preprocess(data)


def test_decompression_bomb_refused_from_header():
    tiny = build_encoder(EncoderSpec(family="tiny-vit", options={"max_decode_pixels": 100 * 100}))
    with pytest.raises(MediaError, match="limit is 10000"):
        tiny.preprocess(image_bytes(200, 200))


def test_bad_specs_say_what_to_fix():
    with pytest.raises(ValueError, match="unknown model family 'nope'"):
        build_encoder(EncoderSpec(family="nope"))
    with pytest.raises(ValueError, match="unknown tiny-vit options"):
        build_encoder(EncoderSpec(family="tiny-vit", options={"hiden_size": 3}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_gpu_says_what_to_fix():
    with pytest.raises(ValueError, match="torch sees no GPU"):
        build_encoder(EncoderSpec(family="tiny-vit", device="cuda"))
