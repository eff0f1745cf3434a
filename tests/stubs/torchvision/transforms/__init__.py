"""Import-only stand-in: see ``torchvision/__init__.py``."""

from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode"]
