"""Import-only stand-in: see ``torchvision/__init__.py``."""

from torchvision._unavailable import module_getattr

__getattr__ = module_getattr("io")
