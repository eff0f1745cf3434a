"""An import-only torchvision for vLLM's model inspection on a CPU-only machine.

transformers 5.24's ``qwen2_vl`` image-processing module imports torchvision at
module level, and vLLM imports ``smart_resize`` from it and builds the HF
Qwen2.5-VL processor, whose video processor exists only with torchvision.
torchvision cannot be installed beside the CPU build of torch 2.13, so
``tests/stubs/torchvision`` stands in: its modules import, its functions raise.
Only ``vllm_env`` installs it, never the encoder replicas (Ray workers never get
it on their path).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys

STUBS_DIR = str(pathlib.Path(__file__).resolve().parent / "stubs")


def install() -> None:
    if STUBS_DIR not in sys.path:
        sys.path.insert(0, STUBS_DIR)
    if "transformers" in sys.modules:
        _redecide_torchvision()


def _redecide_torchvision() -> None:
    """Make a transformers imported before the stub see it, as one imported after would.

    ``import transformers`` caches ``is_torchvision_available()`` for the
    process; its top-level module chooses real or dummy torchvision classes by
    an if/else; each lazy ``transformers.models.*`` module records, when
    created, which names miss a backend; AutoVideoProcessor's module blanks its
    table of video processors in place. Each is redone here, with transformers'
    own machinery where there is one.
    """
    from transformers.utils import import_utils

    if import_utils.is_torchvision_available():
        return  # it already saw the stub
    import_utils.is_torchvision_available.cache_clear()
    import_utils.is_torchvision_v2_available.cache_clear()
    if not import_utils.is_torchvision_available():
        raise RuntimeError(f"transformers does not see the torchvision stub in {STUBS_DIR}")

    # Re-run the top-level __init__ (transformers' `direct_transformers_import`; that __init__
    # is written to run twice) and move its bookkeeping into the module object everyone holds.
    top = sys.modules["transformers"]
    fresh = import_utils.direct_transformers_import(os.path.dirname(top.__file__))
    sys.modules["transformers"] = top
    for attr in ("_class_to_module", "_modules", "_import_structure", "_object_missing_backend", "__all__",
                 "_objects", "_explicit_import_shortcut"):
        if attr in fresh.__dict__:
            setattr(top, attr, fresh.__dict__[attr])
    for name, value in list(top.__dict__.items()):
        placeholder = isinstance(value, import_utils.DummyObject)
        pil_fallback = name.endswith("ImageProcessor") and getattr(value, "__name__", None) == f"{name}Pil"
        if (placeholder or pil_fallback) and name not in top._object_missing_backend:
            del top.__dict__[name]

    # Strike "torchvision" from the submodules' missing backends; drop the placeholders
    # (and Pil fallbacks) already handed out, so the next lookup imports the real class.
    for name, module in list(sys.modules.items()):
        if name.startswith("transformers.") and isinstance(module, import_utils._LazyModule):
            missing = module._object_missing_backend
            for key, backends in list(missing.items()):
                if "torchvision" in backends:
                    if rest := [b for b in backends if b != "torchvision"]:
                        missing[key] = rest
                    else:
                        del missing[key]
                    module.__dict__.pop(key, None)

    if "transformers.models.auto.video_processing_auto" in sys.modules:
        from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
        from transformers.models.auto.video_processing_auto import AutoVideoProcessor
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        for config_class in (Qwen2VLConfig, Qwen2_5_VLConfig):
            AutoVideoProcessor.register(config_class, video_processor_classes={"torchvision": Qwen2VLVideoProcessor},
                                        exist_ok=True)


@contextlib.contextmanager
def on_subprocess_path():
    # vLLM inspects the model class in a fresh subprocess (to keep CUDA out of this one).
    # Only for that: a process-wide PYTHONPATH would reach Ray workers started later.
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [STUBS_DIR, previous]))
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous
