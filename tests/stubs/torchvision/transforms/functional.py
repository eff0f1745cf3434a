"""Import-only stand-in: see ``torchvision/__init__.py``."""

import enum

from torchvision._unavailable import module_getattr


class InterpolationMode(enum.Enum):
    """torchvision's members and values: transformers maps PIL resampling filters onto them at import."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = module_getattr("transforms.functional")
