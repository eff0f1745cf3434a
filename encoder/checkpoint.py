"""Reading only the vision weights of a local Hugging Face checkpoint.

A multimodal checkpoint (``config.json`` plus ``model.safetensors`` or sharded
``model-*.safetensors`` with ``model.safetensors.index.json``) holds the language
model too, usually 90% of the bytes. The encoder never needs it, so this module
reads the safetensors headers, picks the tensors of the requested submodule
(vision tower, projector) by key prefix, and reads just those, shard by shard.
The language model's tensors are never read into memory.

Checkpoints name the same weights differently across transformers versions
(``visual.*`` or ``model.visual.*``; ``vision_tower.vision_model.*`` or
``vision_tower.*``); callers pass every prefix a family uses, and a
``vision_model.`` level is looked for in both spellings.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from typing import Callable, Sequence, TypeVar

import torch
from safetensors import safe_open
from torch import nn

M = TypeVar("M", bound=nn.Module)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """The checkpoint directory is missing, incomplete or not the model it claims to be."""


def read_json(path: str, name: str) -> dict:
    file = os.path.join(path, name)
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{file} not found: model.path must be a local Hugging Face model directory") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc})") from None


def tensor_files(path: str) -> dict[str, str]:
    """Checkpoint key -> safetensors file that holds it (headers only; no tensor is read)."""
    if os.path.isfile(os.path.join(path, INDEX_FILE)):
        weight_map = read_json(path, INDEX_FILE).get("weight_map", {})
        return {key: os.path.join(path, file) for key, file in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}: only safetensors checkpoints are supported")


def _checkpoint_key(key: str, files: dict[str, str], prefixes: Sequence[str]) -> str | None:
    for prefix in prefixes:
        for candidate in (prefix + key, prefix + "vision_model." + key, prefix + key.removeprefix("vision_model.")):
            if candidate in files:
                return candidate
    return None


def construct(factory: Callable[[], M], *, seed: int, from_checkpoint: bool) -> M:
    """Build a module: seeded random weights, or, when a checkpoint will fill them,
    none at all (initialising a 600M-parameter tower only to overwrite it took 36 s)."""
    if from_checkpoint:
        from transformers.initialization import no_init_weights

        context = no_init_weights()
    else:
        context = contextlib.ExitStack()
    with context, torch.random.fork_rng():
        torch.manual_seed(seed)
        return factory()


def load_submodule(module: nn.Module, path: str, prefixes: Sequence[str], files: dict[str, str] | None = None) -> list[str]:
    """Fill ``module`` from the checkpoint keys under ``prefixes``; return the keys read.

    Every parameter must be found; buffers the checkpoint lacks (rotary tables,
    position ids) keep the values the module computed for itself.
    """
    files = tensor_files(path) if files is None else files
    parameters = {name for name, _ in module.named_parameters()}
    wanted: dict[str, str] = {}
    missing = []
    for key in module.state_dict():
        found = _checkpoint_key(key, files, prefixes)
        if found is not None:
            wanted[key] = found
        elif key in parameters:
            missing.append(key)
    if missing:
        raise CheckpointError(
            f"{path} lacks {len(missing)} weights of {type(module).__name__} under {list(prefixes)} "
            f"(first: {missing[:3]}); is model.family right for this checkpoint?"
        )
    by_file: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for key, found in wanted.items():
        by_file[files[found]].append((key, found))
    state: dict[str, torch.Tensor] = {}
    for file, pairs in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for key, found in pairs:
                state[key] = f.get_tensor(found)
    module.load_state_dict(state, strict=False)
    return sorted(wanted.values())


def checkpoint_identity(path: str) -> str:
    """What identifies the weights in ``path``: resolved path, config, and each file's size and mtime."""
    real = os.path.realpath(path)
    parts = [real]
    for name in sorted(os.listdir(real)):
        if name.endswith((".json", ".safetensors")):
            stat = os.stat(os.path.join(real, name))
            parts.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|".join(parts)
