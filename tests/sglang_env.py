"""A dedicated venv with SGLang 0.5.23, for running SGLang's own EPD code on a CPU machine.

Stdlib only: pytest in the project's venv imports this module; the scripts it
serves (``tests/sglang_ranks.py``, ``tests/sglang_encoder_server.py``) run with
the venv's interpreter and import it too (for :func:`write_tiny_qwen2_vl_config`).

:func:`ensure_sglang_python` returns ``<repo>/.venv-sglang/bin/python``, building
the venv on first use with this recipe (FACTS.md, "SGLang 0.5.23's encoder
disaggregation"):

1. ``python -m venv`` from the running interpreter's base Python (3.11: the
   sglang wheel is cp311).
2. ``pip install -c constraints.txt torch==2.13.0`` plus SGLang's import-time
   dependencies (:data:`DEPENDENCIES`). ``constraints.txt`` pins torch, so pip
   never resolves a CUDA build of it.
3. ``pip install --no-deps -c constraints.txt sglang==0.5.23 triton==3.7.1
   torchvision==0.28.0`` (sglang pins a CUDA torch: its dependencies must never
   be resolved).
4. The torchvision shim: torchvision 0.28's ``_meta_registrations`` registers fake
   kernels for ``torchvision::nms``/``qnms`` unconditionally, and its CUDA build
   cannot load its own ops beside CPU torch 2.13, so ``import torchvision``
   raises "operator torchvision::nms does not exist" (and with it sglang, through
   transformers). ``sitecustomize.py`` in the venv's site-packages puts a
   meta-path finder first that, the first time ``torchvision`` is imported,
   imports torch and defines the two schemas with
   ``torch.library.Library("torchvision", "FRAGMENT")``, then lets the normal
   import go on. Nothing is imported at interpreter start-up (pip stays fast).
5. A smoke import of SGLang's encoder receiver and HTTP server (this also writes
   the bytecode caches, so later starts are faster).
6. The marker file ``.sglang-env-complete`` holding the recipe. It is written
   last: a venv without it, or with another recipe in it, is removed and rebuilt.

A file lock (``$TMPDIR/epd-sglang-venv-<hash of the venv path>.lock``) serialises
builds between processes; a process that waited finds the marker and returns at
once. A failed build is not retried in the same process (the same error is raised
again), so a session whose install failed skips quickly.

Example::

    import sglang_env

    try:
        python = sglang_env.ensure_sglang_python()
    except sglang_env.SglangEnvError as exc:
        pytest.skip(str(exc))
    subprocess.run([python, sglang_env.RANKS_SCRIPT, "--encoder-url", url, ...], env=sglang_env.script_env())
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

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

MARKER_NAME = ".sglang-env-complete"
PIP_STEP_TIMEOUT_S = 1800
SMOKE_IMPORTS = (
    "import torchvision, sglang.srt.disaggregation.encoder.receiver, "
    "sglang.srt.disaggregation.encoder.http_server"
)

_SHIM = '''\
"""Written by tests/sglang_env.py: make torchvision 0.28 importable beside CPU torch 2.13.

torchvision's _meta_registrations registers fake kernels for torchvision::nms and
torchvision::qnms at import; the CUDA wheel's own ops library does not load here,
so those operators do not exist and the import fails. Define the two schemas
first, on the first import of torchvision only (nothing is imported at start-up).
"""
import sys


class _TorchvisionOpSchemas:
    _lib = None

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "torchvision" or cls._lib is not None:
            return None
        import torch

        cls._lib = torch.library.Library("torchvision", "FRAGMENT")
        for schema in (
            "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
        ):
            try:
                cls._lib.define(schema)
            except RuntimeError:  # already defined (torchvision's own ops did load)
                pass
        return None  # let the regular finders import torchvision


sys.meta_path.insert(0, _TorchvisionOpSchemas)
'''

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


class SglangEnvError(RuntimeError):
    """Building the SGLang venv failed; the message names the step and ends with its last output lines."""


_FAILED: dict[str, SglangEnvError] = {}


def recipe() -> dict:
    """What the marker records; a venv built with another recipe is rebuilt."""
    return {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "dependencies": list(DEPENDENCIES),
        "no_deps": list(NO_DEPS),
        "constraints": list(CONSTRAINTS),
        "shim": _SHIM,
    }


def venv_python(venv_dir: str | os.PathLike | None = None) -> str:
    return str(pathlib.Path(venv_dir or DEFAULT_VENV_DIR) / "bin" / "python")


def is_complete(venv_dir: str | os.PathLike | None = None) -> bool:
    """True if the venv's marker is there and records the current recipe."""
    marker = pathlib.Path(venv_dir or DEFAULT_VENV_DIR) / MARKER_NAME
    try:
        return json.loads(marker.read_text()).get("recipe") == recipe() and os.access(venv_python(venv_dir), os.X_OK)
    except (OSError, ValueError):
        return False


def ensure_sglang_python(venv_dir: str | os.PathLike | None = None, *, log=None) -> str:
    """Return the interpreter of the SGLang venv, building the venv first if needed.

    Args:
        venv_dir: where the venv lives; default ``<repo>/.venv-sglang`` (or
            ``$EPD_SGLANG_VENV`` when set).
        log: optional callable given one line per step (e.g. ``print``).

    Returns:
        The path of the venv's ``bin/python``.

    Raises:
        SglangEnvError: a step failed; its message says which (the exact
            command, its exit status and its last output lines). The half-built
            venv is left without a marker, so the next call rebuilds it.
    """
    venv = pathlib.Path(venv_dir or os.environ.get("EPD_SGLANG_VENV") or DEFAULT_VENV_DIR).resolve()
    if is_complete(venv):
        return venv_python(venv)
    if str(venv) in _FAILED:  # one failed build per process is enough: don't pay it again per test
        raise _FAILED[str(venv)]
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(_lock_path(venv), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then look again
        try:
            if not is_complete(venv):
                _build(venv, log or (lambda line: None))
        except SglangEnvError as exc:
            _FAILED[str(venv)] = exc
            raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return venv_python(venv)


def _lock_path(venv: pathlib.Path) -> str:
    """A lock file per venv path, in the temp folder (nothing to ignore in the repository)."""
    digest = hashlib.sha256(str(venv).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"epd-sglang-venv-{digest}.lock")


def _build(venv: pathlib.Path, log) -> None:
    started = time.monotonic()
    if venv.exists():
        log(f"removing the incomplete SGLang venv at {venv}")
        shutil.rmtree(venv)
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    _run("create the venv", [base_python, "-m", "venv", str(venv)], log)
    python = venv_python(venv)
    constraints = venv / "constraints.txt"
    constraints.write_text("".join(f"{line}\n" for line in CONSTRAINTS))
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-c", str(constraints)]
    _run("pip install torch and SGLang's import-time dependencies", [*pip, *DEPENDENCIES], log)
    _run("pip install --no-deps sglang, triton, torchvision", [*pip, "--no-deps", *NO_DEPS], log)
    site_packages = _run("find the venv's site-packages",
                         [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], log).strip()
    pathlib.Path(site_packages, "sitecustomize.py").write_text(_SHIM)
    _run("smoke-import SGLang's encoder receiver and HTTP server", [python, "-c", SMOKE_IMPORTS], log,
         env=script_env())
    (venv / MARKER_NAME).write_text(json.dumps(
        {"recipe": recipe(), "built_s": round(time.monotonic() - started, 1), "built_at": time.time()}, indent=1))
    log(f"SGLang venv ready at {venv} in {time.monotonic() - started:.0f} s")


def _run(step: str, cmd: list[str], log, env: dict | None = None) -> str:
    log(f"{step}: {' '.join(cmd)}")
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=PIP_STEP_TIMEOUT_S, env=env if env is not None else _pip_env())
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        raise SglangEnvError(f"SGLang venv: step '{step}' timed out after {PIP_STEP_TIMEOUT_S} s: {' '.join(cmd)}\n"
                             f"{_tail(out)}") from None
    except OSError as exc:
        raise SglangEnvError(f"SGLang venv: step '{step}' could not start: {' '.join(cmd)}: {exc}") from None
    if proc.returncode != 0:
        raise SglangEnvError(f"SGLang venv: step '{step}' failed with exit status {proc.returncode}: "
                             f"{' '.join(cmd)}\n{_tail(proc.stdout)}")
    log(f"  ... {time.monotonic() - started:.1f} s")
    return proc.stdout


def _tail(output: str, lines: int = 25, width: int = 400) -> str:
    kept = [line if len(line) <= width else line[:width] + " ..."
            for line in output.splitlines() if not line.startswith("WARNING: Location ")]
    return "\n".join(kept[-lines:])


def _pip_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def script_env(extra: dict | None = None) -> dict:
    """Environment for the SGLang-venv scripts: the loopback as SGLang's host IP, no foreign PYTHONPATH.

    ``SGLANG_HOST_IP`` is what ``sglang.srt.utils.network.get_local_ip_auto``
    returns first; the receivers bind their PULL sockets on it and advertise it.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
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
