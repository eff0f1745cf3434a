"""Import-only stand-in for torchvision, for the vLLM scheduler/connector tests.

The real torchvision cannot be imported beside the CPU build of torch 2.13
(``operator torchvision::nms does not exist``). vLLM needs it importable: it
imports ``smart_resize`` from transformers' ``qwen2_vl`` image-processing
module, which imports ``torchvision.transforms.v2.functional``, and it builds
the HF Qwen2.5-VL processor, whose video processor transformers only offers
with torchvision. Every module here imports; every function raises
``RuntimeError`` if called. ``InterpolationMode`` is a real enum because
transformers builds lookup tables from it at import.

With this on ``sys.path`` transformers reports torchvision as available and
imports ``transforms``, ``transforms.functional``, ``transforms.v2.functional``
and ``io`` from it. The low ``__version__`` keeps transformers' "prefer the PIL
backend for LANCZOS" rule for old torchvision.

Only ``tests/vllm_env.py`` puts this folder on the path (and on vLLM's
model-inspection subprocess's ``PYTHONPATH``). Never install it; keep it out of
the encoder replicas' environment.
"""

__version__ = "0.0.0+stub"
