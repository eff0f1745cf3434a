"""A venv with SGLang 0.5.23, for running SGLang's own EPD code on a CPU machine.

Stdlib only: pytest in the project's venv imports this module; the scripts it
serves (``tests/sglang_ranks.py``, ``tests/sglang_encoder_server.py``) run with
the venv's interpreter and import it too (for :func:`write_tiny_qwen2_vl_config`).

:func:`ensure_sglang_python` returns ``<repo>/.venv-sglang/bin/python`` (or the
venv at ``$EPD_SGLANG_VENV``), built on first use by ``tests/side_venvs.py`` from
:data:`RECIPE` (FACTS.md, "SGLang 0.5.23's encoder disaggregation"):

1. torch 2.13.0 (pinned by the constraints) and SGLang's import-time dependencies
   (:data:`DEPENDENCIES`).
2. ``--no-deps sglang==0.5.23 triton==3.7.1 torchvision==0.28.0`` (sglang pins a
   CUDA torch: its dependencies must never be resolved).
3. The torchvision shim: torchvision 0.28's ``_meta_registrations`` registers fake
   kernels for ``torchvision::nms``/``qnms`` unconditionally, and its CUDA build
   cannot load its own ops beside CPU torch 2.13, so ``import torchvision``
   raises "operator torchvision::nms does not exist" (and with it sglang, through
   transformers). ``sitecustomize.py`` in the venv's site-packages puts a
   meta-path finder first that, the first time ``torchvision`` is imported,
   imports torch and defines the two schemas with
   ``torch.library.Library("torchvision", "FRAGMENT")``, then lets the normal
   import go on. Nothing is imported at interpreter start-up (pip stays fast).
4. A smoke import of SGLang's encoder receiver and HTTP server.

Example::

    import sglang_env

    try:
        python = sglang_env.ensure_sglang_python()
    except sglang_env.SglangEnvError as exc:
        pytest.skip(str(exc))
    subprocess.run([python, sglang_env.RANKS_SCRIPT, "--encoder-url", url, ...], env=sglang_env.script_env())
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import side_venvs

SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.13.0"
TRANSFORMERS_VERSION = "5.19.0"

# Import-time dependencies of the sglang modules the harness imports: the EPD receiver and
# encoder server, and tokenizer_manager (uvloop) for its zmq_to_tokenizer abort rule.
# Everything else sglang pins is left out on purpose.
DEPENDENCIES = (
    f"torch=={TORCH_VERSION}", "numpy", "pyzmq", "aiohttp", "fastapi", "uvicorn", "msgspec", "psutil", "orjson",
    "requests", "pillow", f"transformers=={TRANSFORMERS_VERSION}", "pybase64", "IPython", "dill",
    "apache-tvm-ffi==0.1.11", "sentencepiece", "compressed-tensors", "gguf", "openai", "partial-json-parser",
    "einops", "uvloop",
)
NO_DEPS = (f"sglang=={SGLANG_VERSION}", "triton==3.7.1", "torchvision==0.28.0")
CONSTRAINTS = (f"torch=={TORCH_VERSION}",)

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS_DIR = pathlib.Path(__file__).resolve().parent
DEFAULT_VENV_DIR = REPO_ROOT / ".venv-sglang"
RANKS_SCRIPT = str(TESTS_DIR / "sglang_ranks.py")
ENCODER_SERVER_SCRIPT = str(TESTS_DIR / "sglang_encoder_server.py")

SMOKE_IMPORTS = (
    "import torchvision, sglang.srt.disaggregation.encoder.receiver, "
    "sglang.srt.disaggregation.encoder.http_server"
)


# Qwen2-VL-2B's text and vision widths, one text layer: only a config (no weights) is ever
# written, so the sizes cost nothing; SGLang reads it for ServerArgs and the model type.
_TINY_QWEN2_VL_CONFIG = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_attention_heads": 12,
    "num_hidden_layers": 1,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 1, "embed_dim": 1280, "hidden_size": 1536, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
    },
}


RECIPE = side_venvs.Recipe(
    name="SGLang",
    venv_dir=DEFAULT_VENV_DIR,
    env_var="EPD_SGLANG_VENV",
    installs=(DEPENDENCIES, ("--no-deps", *NO_DEPS)),
    constraints=CONSTRAINTS,
    files=(("sitecustomize.py", side_venvs.TORCHVISION_OPS_SHIM),),
    smoke=SMOKE_IMPORTS,
    smoke_env={"SGLANG_HOST_IP": "127.0.0.1"},
)

SglangEnvError = side_venvs.VenvError


def ensure_sglang_python(venv_dir: str | os.PathLike | None = None, *, log=None) -> str:
    """The interpreter of the SGLang venv, built first if needed (``side_venvs.ensure``)."""
    return side_venvs.ensure(RECIPE, venv_dir, log=log)


def script_env(extra: dict | None = None) -> dict:
    """Environment for the SGLang-venv scripts: the loopback as SGLang's host IP, no foreign PYTHONPATH.

    ``SGLANG_HOST_IP`` is what ``sglang.srt.utils.network.get_local_ip_auto``
    returns first; the receivers bind their PULL sockets on it and advertise it.
    """
    env = side_venvs.clean_env()
    env.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    env.update(extra or {})
    return env


def write_tiny_qwen2_vl_config(path: str | os.PathLike) -> str:
    """Write a config-only Qwen2-VL model folder (``config.json``, no weights, no processor) and return it.

    SGLang's ``ServerArgs``/``ModelConfig`` read it offline; nothing loads weights.
    """
    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(_TINY_QWEN2_VL_CONFIG, indent=1))
    return str(folder)


if __name__ == "__main__":  # python tests/sglang_env.py: build (or find) the venv and print its python
    t0 = time.monotonic()
    print(ensure_sglang_python(log=lambda line: print(line, flush=True)))
    print(f"{time.monotonic() - t0:.1f} s", file=sys.stderr)
