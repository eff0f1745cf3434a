"""Each family stages, per token, exactly as many values as SGLang's encoder server sends for
the same model (SGLang 0.5.23, ``disaggregation/encoder/server.py``; FACTS.md): a language
server reads ``shape`` from the sender and splits the last axis by its own rule, so a width
that differs breaks it even when the token count is right.

One row per checkpoint; a new family adds its row with the rule SGLang applies to it.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from checkpoints_gemma3 import save_gemma3
from checkpoints_internvl import save_internvl
from checkpoints_qwen3_vl import save_qwen3_5, save_qwen3_vl
from encoder import EncoderSpec, build_encoder
from models import save_llava, save_qwen2_5_vl, save_qwen2_vl
from support import image_bytes


def projector_width(config: Any) -> int:
    """Most models: the projector (or merger) maps into the language model's hidden size."""
    return config.text_config.hidden_size


def deepstack_width(config: Any) -> int:
    """Qwen3-VL and Qwen3.5: the merger's output, then one more of it per DeepStack level
    (Qwen3.5 has none)."""
    vision = config.vision_config
    return vision.out_hidden_size * (1 + len(getattr(vision, "deepstack_visual_indexes", None) or ()))


# checkpoint -> (save(path) -> model, model.family, SGLang's width rule)
WIDTHS: dict[str, tuple[Callable[[str], Any], str, Callable[[Any], int]]] = {
    "qwen2_5_vl": (save_qwen2_5_vl, "qwen2_5_vl", projector_width),
    "qwen2_vl": (save_qwen2_vl, "qwen2_vl", projector_width),
    "llava-clip": (lambda path: save_llava(path, vision="clip"), "llava", projector_width),
    "llava-siglip": (lambda path: save_llava(path, vision="siglip"), "llava", projector_width),
    "qwen3_vl": (save_qwen3_vl, "qwen3_vl", deepstack_width),
    "qwen3_5": (save_qwen3_5, "qwen3_vl", deepstack_width),
    "gemma3": (save_gemma3, "gemma3", projector_width),
    "internvl": (save_internvl, "internvl", projector_width),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(name)`` -> (path, model): each checkpoint is made once per module."""
    made: dict[str, tuple[str, Any]] = {}

    def get(name: str) -> tuple[str, Any]:
        if name not in made:
            path = str(tmp_path_factory.mktemp(name))
            made[name] = path, WIDTHS[name][0](path)
        return made[name]

    return get


@pytest.mark.parametrize("name", sorted(WIDTHS))
def test_staged_width_is_the_width_sglang_sends(name, saved):
    path, model = saved(name)
    _, family, rule = WIDTHS[name]
    encoder = build_encoder(EncoderSpec(family=family, path=path))
    item = encoder.encode_batch([encoder.preprocess(image_bytes(150, 100, seed=5))])[0]
    assert item.meta["shape"][1] == rule(model.config)


def test_the_qwen3_vl_checkpoint_has_deepstack_levels(saved):
    """The rule is not vacuous: two levels make the width three times the language model's."""
    config = saved("qwen3_vl")[1].config
    assert deepstack_width(config) == 3 * projector_width(config)


@pytest.mark.parametrize("name", sorted(WIDTHS))
def test_a_vllm_consumer_s_placeholder_has_the_staged_width(name, saved):
    """A failed load leaves zeros in vLLM's encoder cache; a Qwen3-VL model splits that entry
    on the last axis, so it must be as wide as a staged one."""
    from types import SimpleNamespace

    from registry.engines.vllm.worker import _image_width

    config, rule = saved(name)[1].config, WIDTHS[name][2]
    # What the worker reads of vLLM's ModelConfig: the HF config and the LM's input width.
    model_config = SimpleNamespace(hf_config=config, get_inputs_embeds_size=lambda: config.text_config.hidden_size)
    assert _image_width(model_config) == rule(config)
