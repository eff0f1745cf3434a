"""Tiny full checkpoints an engine loads: weights, tokenizer, processor and chat template.

``models.save_*`` builds each model and saves its weights and image processor; an engine
also needs a tokenizer and a chat template. Each ``save_*_for_engines`` adds a
WordLevel ``tokenizers`` tokenizer over the model's 1,000 ids whose special tokens carry
the config's ids (ordinary tokens are spelled ``t<id>``) and a small chat template; for
LLaVA, the processor config vLLM's LLaVA processor reads (the image token, the patch size
and the feature strategy).

``lm_head_scale``: a random tiny model's logits are nearly uniform, and greedy decoding
over near-ties flips between float32 and bfloat16 or between TP layouts for reasons that
have nothing to do with the embeddings. Scaling the LM head spreads the logits, so equal
tokens test what they should: that the engine got the same embeddings.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable

from models import LLAVA_IMAGE_TOKEN, QWEN_IMAGE_TOKEN, QWEN_VIDEO_TOKEN, QWEN_VISION_END, QWEN_VISION_START, save_llava, save_qwen2_5_vl
from checkpoints_qwen3_vl import save_qwen3_5_for_engines, save_qwen3_vl_for_engines
from checkpoints_gemma3 import GEMMA3_IMAGE, save_gemma3_for_engines
from checkpoints_internvl import INTERNVL_IMAGE, save_internvl_for_engines

MAX_MODEL_LEN = 4096
UNK = 3
LM_HEAD_SCALE = 16.0
# vLLM's CPU attention kernels take head sizes from 32 up ("Unsupported CPU attention
# configuration: head_dim=16"): 64 here.
ENGINE_TEXT = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
_BASE = {"<pad>": 0, "<s>": 1, "</s>": 2}
# Qwen2-VL's spellings: vLLM's Qwen2-VL processor looks these up in the vocabulary.
QWEN_SPECIAL = {
    **_BASE, "<|vision_end|>": QWEN_VISION_END, "<|vision_start|>": QWEN_VISION_START,
    "<|video_pad|>": QWEN_VIDEO_TOKEN, "<|image_pad|>": QWEN_IMAGE_TOKEN,
}
LLAVA_SPECIAL = {**_BASE, "<image>": LLAVA_IMAGE_TOKEN}
QWEN_IMAGE = "<|vision_start|> <|image_pad|> <|vision_end|>"  # one image in a Qwen prompt
LLAVA_IMAGE = "<image>"

_CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url', 'image_embeds') %}IMAGE"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %} {% endfor %}{% endif %}</s> "
    "{% endfor %}{% if add_generation_prompt %}<s>assistant {% endif %}"
)


def save_qwen_for_engines(path: str, seed: int = 0, lm_head_scale: float = LM_HEAD_SCALE):
    """``models.save_qwen2_5_vl`` plus its tokenizer and chat template; returns the model."""
    model = save_qwen2_5_vl(path, seed=seed, lm_head_scale=lm_head_scale, text=ENGINE_TEXT)
    _save_tokenizer(path, model.config.text_config.vocab_size, QWEN_SPECIAL, QWEN_IMAGE)
    return model


def save_llava_for_engines(path: str, seed: int = 0, lm_head_scale: float = LM_HEAD_SCALE):
    """``models.save_llava`` (a CLIP tower) plus its tokenizer, chat template and processor config."""
    model = save_llava(path, seed=seed, lm_head_scale=lm_head_scale, text=ENGINE_TEXT)
    tokenizer = _save_tokenizer(path, model.config.text_config.vocab_size, LLAVA_SPECIAL, LLAVA_IMAGE)
    from transformers import AutoImageProcessor, LlavaProcessor

    LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(path), tokenizer=tokenizer, image_token=LLAVA_IMAGE,
        patch_size=model.config.vision_config.patch_size, chat_template=tokenizer.chat_template,
        vision_feature_select_strategy=model.config.vision_feature_select_strategy, num_additional_image_tokens=1,
    ).save_pretrained(path)
    _hub_llava_layout(path)
    return model


@dataclasses.dataclass(frozen=True)
class EngineCheckpoint:
    """A tiny full checkpoint an engine loads, as the engine tests use it."""

    save: Callable[[str], Any]  # save(path): weights, processor, tokenizer and chat template
    image: str  # one image's placeholder in a prompt
    family: str = ""  # the service's model.family, when it differs from the table's key


# Keyed by what the tests call the checkpoint (its vLLM architecture's family).
ENGINE_CHECKPOINTS = {
    "qwen2_5_vl": EngineCheckpoint(save_qwen_for_engines, QWEN_IMAGE),
    "llava": EngineCheckpoint(save_llava_for_engines, LLAVA_IMAGE),
    "qwen3_vl": EngineCheckpoint(save_qwen3_vl_for_engines, QWEN_IMAGE),
    "qwen3_5": EngineCheckpoint(save_qwen3_5_for_engines, QWEN_IMAGE, family="qwen3_vl"),
    "gemma3": EngineCheckpoint(save_gemma3_for_engines, GEMMA3_IMAGE),
    "internvl": EngineCheckpoint(save_internvl_for_engines, INTERNVL_IMAGE),
}


def engine_family(name: str) -> str:
    """The service's ``model.family`` for the engine checkpoint ``name``."""
    return ENGINE_CHECKPOINTS[name].family or name


def prompt(images: int, image: str, text_ids: tuple[int, ...] = (5, 6, 7)) -> str:
    """A prompt with ``images`` placeholders ``image``, each followed by ordinary tokens."""
    words = ["<s>", "t4"]
    for _ in range(images):
        words += [image, *(f"t{i}" for i in text_ids)]
    return " ".join(words)


def _save_tokenizer(path: str, vocab_size: int, special: dict[str, int], image: str, roles: dict[str, str] | None = None):
    """``roles``: named special tokens a processor reads as tokenizer attributes (``boi_token=...``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    by_id = {i: f"t{i}" for i in range(vocab_size)}
    by_id.update({i: token for token, i in special.items()})
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in by_id.items()}, unk_token=by_id[UNK]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token=by_id[UNK],
        additional_special_tokens=[t for t in special if t not in _BASE],
        chat_template=_CHAT_TEMPLATE.replace("IMAGE", image), model_max_length=MAX_MODEL_LEN, **(roles or {}),
    )
    tokenizer.save_pretrained(path)
    added = json.loads(pathlib.Path(path, "tokenizer.json").read_text())["added_tokens"]
    if wrong := {t["content"]: t["id"] for t in added if special.get(t["content"], t["id"]) != t["id"]}:
        raise AssertionError(f"the tokenizer gave special tokens ids other than the config's: {wrong}")
    return tokenizer



def _hub_llava_layout(path: str) -> None:
    """Rename the tower's weights ``vision_tower.X`` -> ``vision_tower.vision_model.X``, the
    layout of LLaVA checkpoints on the Hub (``llava-hf/*``), which vLLM requires ("no module or
    parameter named 'vision_tower.embeddings'" otherwise); transformers 5 saves the other."""
    from safetensors.torch import load_file, save_file

    def renamed(key: str) -> str:
        if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
            return "vision_tower.vision_model." + key.removeprefix("vision_tower.")
        return key

    index_path = pathlib.Path(path, "model.safetensors.index.json")
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(pathlib.Path(path, shard))
        save_file({renamed(k): v for k, v in tensors.items()}, pathlib.Path(path, shard), metadata={"format": "pt"})
    index["weight_map"] = {renamed(k): shard for k, shard in index["weight_map"].items()}
    index_path.write_text(json.dumps(index, indent=2))
