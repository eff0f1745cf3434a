"""The contract every vision tower implements, and the batch loop around it.

A ``VisionEncoder`` has two hooks:

* ``preprocess(data)``: bytes of one image -> ``PreparedItem`` (CPU only, may raise
  ``MediaError``); runs per item, outside the batch, so a bad item fails alone
  (``preprocess_video(video)`` likewise, for families that take video);
* ``embed(items)``: a batch of prepared items -> one embedding per item, on the
  encoder's device and dtype, in input order. Towers that take a padded batch
  subclass ``StackingEncoder`` and implement ``forward`` on stacked pixels;
  towers that pack variable-length sequences (Qwen2-VL) implement ``embed``.

``encode_batch`` runs ``embed`` under ``torch.inference_mode`` and turns the
tensors into ``EncodedItem``s. New families add a subclass and an entry in
``encoder.loader``.
"""

from __future__ import annotations

import abc
from collections import defaultdict
from typing import Sequence

import torch

from encoder.hashing import content_hash
from encoder.media import MediaError
from encoder.types import EncodedItem, Media, PreparedItem, Video


class VisionEncoder(abc.ABC):
    """A vision tower plus its preprocessing, on one device and dtype."""

    #: Changes whenever the embeddings for the same bytes could change (family,
    #: weights, preprocessing settings); it is part of every ``mm_hash``.
    identity: str
    device: torch.device
    dtype: torch.dtype

    @abc.abstractmethod
    def preprocess(self, data: bytes) -> PreparedItem:
        """Decode and preprocess one image's bytes; raise ``MediaError`` if unusable."""

    def preprocess_video(self, video: Video) -> PreparedItem:
        """Decode and preprocess a video's frames; families without video support refuse."""
        raise MediaError(f"this model ({type(self).__name__}) takes images only; send each frame as an image")

    def prepare(self, media: Media) -> PreparedItem:
        """``preprocess`` or ``preprocess_video``, by what the item is."""
        if isinstance(media, Video):
            return self.preprocess_video(media)
        return self.preprocess(media)

    @abc.abstractmethod
    def embed(self, items: Sequence[PreparedItem]) -> list[torch.Tensor]:
        """One embedding per item, in order (called under ``torch.inference_mode``)."""

    def mm_hash(self, data: Media) -> str:
        """Content hash of the item bytes under this model and its preprocessing."""
        return content_hash(data, self.identity)

    def encode_batch(self, items: Sequence[PreparedItem]) -> list[EncodedItem]:
        """Embed ``items`` (any mix of shapes) and return them in input order."""
        with torch.inference_mode():
            embeddings = self.embed(items)
        return [EncodedItem.from_tensor(e, item) for e, item in zip(embeddings, items, strict=True)]


class StackingEncoder(VisionEncoder):
    """A tower that takes ``[batch, ...]`` pixels: items with equal ``batch_key`` share a pass."""

    @abc.abstractmethod
    def forward(self, pixels: torch.Tensor, batch_key: tuple) -> Sequence[torch.Tensor]:
        """Embed a stacked batch (already on ``device``/``dtype``); one tensor per item."""

    def embed(self, items: Sequence[PreparedItem]) -> list[torch.Tensor]:
        groups: dict[tuple, list[int]] = defaultdict(list)
        for index, item in enumerate(items):
            groups[item.batch_key].append(index)
        out: list[torch.Tensor | None] = [None] * len(items)
        for key, indices in groups.items():
            pixels = torch.stack([items[i].pixels for i in indices])
            pixels = pixels.to(self.device, self.dtype, non_blocking=True)
            for i, embedding in zip(indices, self.forward(pixels, key), strict=True):
                out[i] = embedding
        return out  # type: ignore[return-value]
