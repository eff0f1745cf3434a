"""Images with transparency preprocess as transformers' own processors do (no Ray).

transformers (``image_transforms.convert_to_rgb``, called by every Pil processor) and
vLLM (``multimodal.image.convert_image_mode``) composite transparency onto white; a
plain ``convert("RGB")`` keeps the colour under transparent pixels instead. Each file
below is compared with transformers run on the same bytes, opened but not converted,
so transformers does its own conversion.
"""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.image_transforms import convert_to_rgb
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

from encoder import EncoderSpec, build_encoder
from encoder.media import open_image

WIDTH, HEIGHT = 64, 48


def _encode(image: Image.Image, fmt: str = "PNG", **params) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **params)
    return out.getvalue()


def _colours(seed: int = 0) -> np.ndarray:
    """Random colours; none of them white, so a transparent pixel left as is shows."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 200, size=(HEIGHT, WIDTH, 3), dtype=np.uint8)


def _alpha() -> np.ndarray:
    """Every alpha value from 0 to 255; row 0 fully transparent, row 1 opaque."""
    alpha = (np.arange(HEIGHT * WIDTH) % 256).astype(np.uint8).reshape(HEIGHT, WIDTH)
    alpha[0], alpha[1] = 0, 255
    return alpha


def rgba_png() -> bytes:
    return _encode(Image.fromarray(np.dstack([_colours(), _alpha()]), "RGBA"))


def la_png() -> bytes:
    return _encode(Image.fromarray(np.dstack([_colours()[..., 0], _alpha()]), "LA"))


def palette_png() -> bytes:
    """A "P" image whose palette entry 3 is transparent (a PNG tRNS chunk)."""
    image = Image.fromarray(_colours()).quantize(16)
    assert image.getpalette()[9:12] != [255, 255, 255]
    assert 3 in np.asarray(image)
    return _encode(image, transparency=3)


def palette_alpha_png() -> bytes:
    """A "P" image with an alpha per palette entry (tRNS as pngquant writes it), 0 to 255."""
    image = Image.fromarray(_colours()).quantize(16)
    return _encode(image, transparency=bytes([0, 255] + list(range(16, 256, 18))))


def rgb_png() -> bytes:
    return _encode(Image.fromarray(_colours(seed=1)))


TRANSPARENT = {"rgba": rgba_png, "la": la_png, "palette": palette_png, "palette_alpha": palette_alpha_png}
# Controls without transparency: opaque RGB, grey and CMYK.
OPAQUE = {
    "rgb": rgb_png,
    "l": lambda: _encode(Image.fromarray(_colours()[..., 0])),
    "cmyk_jpeg": lambda: _encode(Image.fromarray(_colours()).convert("CMYK"), "JPEG"),
}
FILES = {**TRANSPARENT, **OPAQUE}


def reference_rgb(data: bytes) -> np.ndarray:
    """transformers' conversion of the file as it opens, as its Pil processors apply it."""
    return convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)


def served_rgb(data: bytes) -> np.ndarray:
    return np.asarray(open_image(data, max_pixels=1 << 20, min_side=1))


@pytest.fixture(scope="module")
def qwen():
    return build_encoder(EncoderSpec(family="qwen2_5_vl"))


@pytest.mark.filterwarnings("ignore:Palette images with Transparency:UserWarning")  # the old convert("RGB")
def test_the_transparent_files_really_have_transparency():
    modes = {name: Image.open(io.BytesIO(make())) for name, make in TRANSPARENT.items()}
    assert [image.mode for image in modes.values()] == ["RGBA", "LA", "P", "P"]
    assert modes["palette"].info["transparency"] == 3
    assert len(modes["palette_alpha"].info["transparency"]) == 16
    # Dropping alpha gives another image: the comparisons below can tell the two apart.
    for name, make in TRANSPARENT.items():
        dropped = np.asarray(Image.open(io.BytesIO(make())).convert("RGB"))
        assert not np.array_equal(dropped, reference_rgb(make())), name


def test_transparent_pixels_come_out_white_and_opaque_ones_unchanged():
    pixels = served_rgb(rgba_png())
    assert (pixels[0] == 255).all()
    assert np.array_equal(pixels[1], _colours()[1])


@pytest.mark.parametrize("name", FILES)
def test_open_image_equals_transformers_conversion(name):
    data = FILES[name]()
    assert np.array_equal(served_rgb(data), reference_rgb(data))


@pytest.mark.parametrize("name", FILES)
def test_qwen_preprocessing_and_embedding_equal_transformers_on_the_file(qwen, name):
    data = FILES[name]()
    assert isinstance(qwen.processor, Qwen2VLImageProcessorPil)
    reference = qwen.processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    prepared = qwen.preprocess(data)
    assert prepared.meta["grid_thw"] == reference["image_grid_thw"][0].tolist()
    assert torch.equal(prepared.pixels, reference["pixel_values"])

    served = qwen.encode_batch([prepared])[0].tensor()
    with torch.inference_mode():
        tower = qwen.tower(reference["pixel_values"], grid_thw=reference["image_grid_thw"]).pooler_output
    assert torch.equal(served, tower)


def exif_rotated_jpeg() -> bytes:
    """A 64x48 photo whose EXIF says "rotate 90 degrees clockwise to display" (orientation 6)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return _encode(Image.fromarray(_colours(seed=2)), "JPEG", exif=exif.tobytes())


@pytest.mark.parametrize("name", [*FILES, "exif_rotated"])
def test_open_image_equals_what_vllm_loads(name):
    # vLLM's own loader for image bytes (the path a chat request's image takes in the engine).
    from vllm.multimodal.media.image import ImageMediaIO

    data = exif_rotated_jpeg() if name == "exif_rotated" else FILES[name]()
    loaded = ImageMediaIO().load_bytes(data)
    expected = np.asarray(getattr(loaded, "media", loaded))
    served = served_rgb(data)
    if name == "exif_rotated":
        assert served.shape == (WIDTH, HEIGHT, 3)  # displayed upright: 48 wide, 64 high
    assert np.array_equal(served, expected)
