"""Benchmarks of the encoder service: ``python -m benchmarks [--quick]`` (``benchmarks.runner``) runs
the sections (``decoder_side``, ``object_store``, ``registry_load``, ``end_to_end``) on a local Ray
cluster of its own, each figure beside a baseline taken side by side. On their own:
``python -m benchmarks.sglang`` (beside SGLang's encoder server) and ``python -m benchmarks.vllm_ttft``
(time to first token against monolithic vLLM). docs/performance.md has the figures and targets.
"""
