"""The embedded default model: a small seeded vision transformer.

It needs no download, runs on a CPU in milliseconds, and behaves like the real
towers where it matters to the service: the number of output tokens follows the
image size (Qwen2-VL style resizing to a multiple of the patch size, clamped to a
pixel budget), items of equal size batch together, and the output width is the
"language model" hidden size after a LLaVA-style two-layer projector.

Weights come from a seeded generator, so every process that builds the model
with the same settings gets bitwise-identical weights; tests rely on that to
compare served embeddings with an in-process forward pass.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from encoder.base import StackingEncoder
from encoder.media import open_image
from encoder.spec import EncoderSpec, spec_options
from encoder.types import PreparedItem


@dataclasses.dataclass(frozen=True)
class TinyViTConfig:
    patch_size: int = 16
    hidden_size: int = 128
    depth: int = 2
    num_heads: int = 4
    out_size: int = 512
    min_pixels: int = 32 * 32
    max_pixels: int = 448 * 448
    max_decode_pixels: int = 64 * 1024 * 1024
    seed: int = 0


def target_size(height: int, width: int, cfg: TinyViTConfig) -> tuple[int, int]:
    """Resize target: multiples of the patch size, area within the pixel budget."""
    p = cfg.patch_size
    h = max(p, round(height / p) * p)
    w = max(p, round(width / p) * p)
    if h * w > cfg.max_pixels:
        beta = math.sqrt(height * width / cfg.max_pixels)
        h = max(p, math.floor(height / beta / p) * p)
        w = max(p, math.floor(width / beta / p) * p)
    elif h * w < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (height * width))
        h = math.ceil(height * beta / p) * p
        w = math.ceil(width * beta / p) * p
    return h, w


def _sincos_2d(rows: int, cols: int, dim: int) -> torch.Tensor:
    """Fixed 2-D sine/cosine position table of shape [rows * cols, dim]."""
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    ys, xs = torch.meshgrid(torch.arange(rows, dtype=torch.float64), torch.arange(cols, dtype=torch.float64), indexing="ij")
    ang_y = ys.reshape(-1, 1) * omega
    ang_x = xs.reshape(-1, 1) * omega
    table = torch.cat([ang_y.sin(), ang_y.cos(), ang_x.sin(), ang_x.cos()], dim=1)
    return table.to(torch.float32)


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    def __init__(self, cfg: TinyViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Built on the meta device: the layers' own random init would be overwritten below
        # anyway, and for a ViT-B-sized tower it costs as much CPU as the init that counts.
        with torch.device("meta"):
            self.patch_embed = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size)
            self.blocks = nn.ModuleList(_Block(cfg.hidden_size, cfg.num_heads) for _ in range(cfg.depth))
            self.norm = nn.LayerNorm(cfg.hidden_size)
            self.projector = nn.Sequential(
                nn.Linear(cfg.hidden_size, cfg.out_size), nn.GELU(), nn.Linear(cfg.out_size, cfg.out_size)
            )
        self.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif param.dim() == 1:  # LayerNorm scale
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02, generator=generator)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        pos = _sincos_2d(grid[0], grid[1], self.cfg.hidden_size).to(patches.device, patches.dtype)
        x = self.patch_embed(patches) + pos
        for block in self.blocks:
            x = block(x)
        return self.projector(self.norm(x))


class TinyViTEncoder(StackingEncoder):
    """``VisionEncoder`` around ``TinyViT``; ``meta["grid"]`` is [rows, cols] of patches."""

    family = "tiny-vit"

    def __init__(self, cfg: TinyViTConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.model = TinyViT(cfg).to(device=device, dtype=dtype).eval()
        self.identity = f"{self.family}:{dataclasses.astuple(cfg)}:{dtype}"

    def preprocess(self, data: bytes) -> PreparedItem:
        cfg = self.cfg
        image = open_image(data, max_pixels=cfg.max_decode_pixels, min_side=cfg.patch_size)
        height, width = target_size(image.height, image.width, cfg)
        if (height, width) != (image.height, image.width):
            image = image.resize((width, height), resample=3)  # 3 = BICUBIC
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy())  # [H, W, 3]
        pixels = pixels.div_(127.5).sub_(1.0)
        p = cfg.patch_size
        rows, cols = height // p, width // p
        patches = pixels.view(rows, p, cols, p, 3).permute(0, 2, 4, 1, 3).reshape(rows * cols, 3 * p * p)
        return PreparedItem(
            pixels=patches.contiguous(),
            mm_hash=self.mm_hash(data),
            meta={"grid": [rows, cols], "image_size": [height, width]},
            batch_key=(rows, cols),
        )

    def forward(self, pixels: torch.Tensor, batch_key: tuple) -> Sequence[torch.Tensor]:
        return self.model(pixels, batch_key).unbind(0)


OPTIONS = TinyViTConfig


def build(spec: EncoderSpec, device: torch.device, dtype: torch.dtype) -> TinyViTEncoder:
    if spec.path is not None:
        raise ValueError("tiny-vit is built from its options and takes no model.path")
    return TinyViTEncoder(spec_options(TinyViTConfig, spec), device, dtype)
