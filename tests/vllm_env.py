"""vLLM 0.33.0's real V1 scheduler and EC-connector plumbing, on a CPU-only machine.

For tests of an EC connector (``registry/vllm_connector.py``). Everything is
vLLM's own: its config classes, its connector factory, ``Request`` and
``MultiModalFeatureSpec``, the V1 ``Scheduler``, and on the worker side
``ensure_ec_transfer_initialized`` plus the GPU model runner's
``ECConnectorModelRunnerMixin.maybe_get_ec_connector_output`` and the
executor's ``ECOutputAggregator``. Nothing of vLLM is mocked. No model forward
runs (the wheel's kernels are CUDA-only): :func:`step` plays the model runner
and samples one token for every request whose prefill is complete.

Importing this module, before it imports vLLM:

- sets ``VLLM_TARGET_DEVICE=cpu`` unless set (without it vLLM's platform has an
  empty device type, and ``ECExampleConnector.start_load_caches`` fails with
  "device  is invalid");
- puts ``tests/stubs`` (an import-only torchvision) first on ``sys.path``.
  transformers 5.24's ``qwen2_vl`` image-processing module imports torchvision,
  vLLM imports ``smart_resize`` from it, and vLLM builds the HF Qwen2.5-VL
  processor, whose video processor transformers only offers with torchvision.
  So transformers must *see* torchvision here: ``is_torchvision_available()``
  is True in this process afterwards. If transformers was imported earlier (as
  it usually is in a test session) and decided "no torchvision", that decision
  is redone (see ``torchvision_stub``). Effect on the rest of the process:
  transformers' Auto classes now pick torchvision-backed processors, which raise
  ``RuntimeError`` if asked to process; the ``*ImageProcessorPil`` classes the
  encoder uses give bitwise-identical output either way (checked for Qwen2-VL,
  CLIP, SigLIP). vLLM also inspects the model in a ``python -m
  vllm.model_executor.models.registry`` subprocess, which gets the stub on
  ``PYTHONPATH`` only while :func:`make_vllm_config` runs.

No forward context is needed: the GPU model runner enters the EC-connector
block in ``_preprocess``, before ``set_forward_context``, and nothing in
``ec_transfer`` reads one.

Worker-role connectors in Ray actors: a ``VllmConfig`` from
:func:`make_vllm_config` pickles with ``pickle`` and ``ray.cloudpickle``
(15.5 KB, under 1 ms each way once vLLM is imported), hf_config included. A
fresh process that receives it needs only ``VLLM_TARGET_DEVICE=cpu``
(:data:`WORKER_ENV_VARS`), not this module or the stub, as long as its
connector builds no HF processor (``ECExampleConnector``'s worker builds none):
there ``pickle.loads`` took 6.3 s (it imports vLLM) and the worker connector
0.4 s. Rebuilding from the model folder with :func:`make_vllm_config` took
8.3 s with vLLM's model-info cache warm (this module's imports, then vLLM's),
about 10 s more when it is cold (the inspection subprocess). Ship the config.

Example::

    import vllm_env  # first: the device and the torchvision stub

    vllm_env.save_tiny_qwen_for_vllm(model_dir)
    cfg = vllm_env.make_vllm_config(model_dir, ec_connector="ECExampleConnector", module_path=None,
                                    extra_config={"shared_storage_path": store_dir})
    scheduler = vllm_env.make_scheduler(cfg)
    scheduler.add_request(vllm_env.image_request("r1", ["img-a", "img-b"], grid_thw=[(1, 8, 8), (1, 4, 4)]))
    vllm_env.worker_connector(cfg)
    cache = {}
    out = vllm_env.step(scheduler, run_workers=lambda so: vllm_env.worker_load(so, cache))
    out.ec_connector_metadata, out.scheduled_encoder_inputs, cache   # loaded here, encoded locally, tensors
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# For the runtime_env of Ray actors that unpickle a config and build worker-role connectors.
WORKER_ENV_VARS = {"VLLM_TARGET_DEVICE": "cpu"}

import torchvision_stub  # noqa: E402 - after VLLM_TARGET_DEVICE is set

torchvision_stub.install()

from engine_checkpoints import MAX_MODEL_LEN, save_qwen_for_engines  # noqa: E402 - after the stub
from models import QWEN_IMAGE_TOKEN, QWEN_VISION_END, QWEN_VISION_START  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

MERGE_SIZE = 2  # spatial_merge_size of the model in tests/models.py
TEXT_TOKEN = 5  # an ordinary token, for prompt text and for every sampled token


# ==============================
# Model folder, config, scheduler
# ==============================

def save_tiny_qwen_for_vllm(path: str):
    """Save a tiny Qwen2.5-VL into ``path`` that vLLM can inspect offline, and return the model:
    ``engine_checkpoints.save_qwen_for_engines`` (weights, image processor, tokenizer, chat
    template), with the LM head as built (no forward runs here)."""
    return save_qwen_for_engines(path, lm_head_scale=1.0)


def make_vllm_config(
    model_dir: str,
    *,
    ec_connector: str,
    module_path: str | None,
    ec_role: str = "ec_consumer",
    extra_config: dict | None = None,
    tensor_parallel_size: int = 1,
    dtype: str = "bfloat16",
    engine_id: str | None = None,
) -> VllmConfig:
    """A validated ``VllmConfig`` for ``model_dir`` with an EC connector, on the CPU.

    Args:
        model_dir: a folder written by :func:`save_tiny_qwen_for_vllm`.
        ec_connector: ``ECTransferConfig.ec_connector``, the class name.
        module_path: ``ec_connector_module_path`` (None for a built-in such as
            ``ECExampleConnector``).
        ec_role: ``ec_consumer``, ``ec_producer`` or ``ec_both``.
        extra_config: ``ec_connector_extra_config``.
        tensor_parallel_size: recorded in ``ParallelConfig`` (world size follows);
            nothing starts, no GPU is needed (checked with 2 and 4).
        dtype: the model dtype.
        engine_id: ``ECTransferConfig.engine_id``; vLLM draws a uuid when None.

    Returns:
        The config: ``DeviceConfig("cpu")``, block size 16, at most 16
        sequences and ``MAX_MODEL_LEN`` tokens per step, synchronous scheduling.
        The first call in a fresh ``VLLM_CACHE_ROOT`` takes about 10 s (vLLM's
        model-inspection subprocess); later ones use vLLM's model-info cache.
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ECTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    with torchvision_stub.on_subprocess_path():
        model_config = ModelConfig(model=model_dir, tokenizer=model_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN,
                                   seed=0)
    return VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=16),
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=MAX_MODEL_LEN, max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False, is_multimodal_model=True, async_scheduling=False,
        ),
        ec_transfer_config=ECTransferConfig(
            ec_connector=ec_connector, ec_connector_module_path=module_path, ec_role=ec_role,
            ec_connector_extra_config=dict(extra_config or {}), engine_id=engine_id,
        ),
    )


def make_scheduler(cfg: VllmConfig, num_blocks: int = 256, block_size: int = 16) -> Scheduler:
    """vLLM's V1 ``Scheduler`` for ``cfg`` with a KV cache of ``num_blocks`` blocks.

    The KV cache is one full-attention group over a placeholder layer: the
    scheduler only counts blocks, no tensor exists. Sets
    ``cfg.cache_config.num_gpu_blocks`` as EngineCore does after profiling. The
    scheduler builds its scheduler-role connector through vLLM's factory;
    ``scheduler.get_ec_connector()`` returns it.
    """
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    cfg.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(vllm_config=cfg, kv_cache_config=kv_cache_config, block_size=block_size,
                     structured_output_manager=StructuredOutputManager(cfg))


# ==============================
# Requests and engine steps
# ==============================

def num_image_tokens(grid_thw: Iterable[int]) -> int:
    """Placeholder tokens of one image: prod(grid_thw) / merge_size**2 (vLLM's
    ``qwen2_vl.py::_get_prompt_updates``). Raises ValueError if it does not divide."""
    tokens, rest = divmod(math.prod(int(v) for v in grid_thw), MERGE_SIZE**2)
    if rest:
        raise ValueError(f"grid_thw {tuple(grid_thw)}: its product is not a multiple of {MERGE_SIZE**2}")
    return tokens


def image_request(
    request_id: str,
    identifiers: list[str],
    grid_thw: list[tuple[int, int, int]] | None = None,
    prompt_prefix: int = 4,
    max_tokens: int = 4,
) -> Request:
    """A ``vllm.v1.request.Request`` with one image item per identifier.

    Prompt: ``prompt_prefix`` text tokens, then per item ``<|vision_start|>``,
    ``num_image_tokens(grid)`` ``<|image_pad|>``, ``<|vision_end|>``, then one
    text token. Each item's ``MultiModalFeatureSpec`` has ``data=None`` (as for
    an item the frontend already cached), the identifier as ``identifier`` and
    ``mm_hash``, and the placeholder range of its image tokens.

    Args:
        grid_thw: one ``(t, h, w)`` per item; default ``(1, 4, 4)`` (4 tokens).
        max_tokens: the request finishes (``FinishReason.LENGTH``) with its
            ``max_tokens``-th sampled token; EOS is ignored.
    """
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    grids = list(grid_thw) if grid_thw is not None else [(1, 4, 4)] * len(identifiers)
    if len(grids) != len(identifiers):
        raise ValueError(f"{len(identifiers)} identifiers but {len(grids)} grids")
    prompt, features = [TEXT_TOKEN] * prompt_prefix, []
    for identifier, grid in zip(identifiers, grids):
        length = num_image_tokens(grid)
        prompt.append(QWEN_VISION_START)
        features.append(MultiModalFeatureSpec(
            data=None, modality="image", identifier=identifier, mm_hash=identifier,
            mm_position=PlaceholderRange(offset=len(prompt), length=length),
        ))
        prompt += [QWEN_IMAGE_TOKEN] * length + [QWEN_VISION_END]
    prompt.append(TEXT_TOKEN)
    return Request(request_id=request_id, prompt_token_ids=prompt, pooling_params=None, mm_features=features,
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@dataclasses.dataclass
class StepResult:
    """One :func:`step`. Reads as its ``SchedulerOutput`` too: ``result.ec_connector_metadata``.

    Attributes:
        scheduler_output: what ``schedule()`` returned (``ec_connector_metadata``;
            ``scheduled_encoder_inputs``: request id -> indices of the items
            encoded locally this step; ``num_scheduled_tokens``; ...).
        engine_outputs: what ``update_from_output`` returned (client index ->
            ``EngineCoreOutputs``).
        ec_connector_output: the ``ECConnectorOutput`` given to the scheduler.
        sampled: ids of the requests that got a token.
        finished: request id -> ``FinishReason`` of the requests that finished
            (``LENGTH`` after max_tokens; ``ERROR`` when the scheduler failed one,
            e.g. from the connector's ``take_unavailable_requests``).
    """

    scheduler_output: SchedulerOutput
    engine_outputs: dict[int, EngineCoreOutputs]
    ec_connector_output: ECConnectorOutput | None
    sampled: list[str]
    finished: dict[str, Any]

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "scheduler_output":
            raise AttributeError(name)
        return getattr(self.scheduler_output, name)


def step(
    scheduler: Scheduler,
    ec_connector_output: ECConnectorOutput | None = None,
    *,
    run_workers: Callable[[SchedulerOutput], ECConnectorOutput | None] | None = None,
) -> StepResult:
    """One engine step with no model: ``schedule()``, the workers, ``update_from_output``.

    Plays the model runner: each scheduled request whose prefill is complete
    after this step (the rows the GPU runner samples) gets ``TEXT_TOKEN``; one
    in a partial prefill gets none.

    Args:
        ec_connector_output: given to the scheduler as
            ``ModelRunnerOutput.ec_connector_output``.
        run_workers: called with this step's ``SchedulerOutput`` between
            ``schedule()`` and ``update_from_output``, as the executor runs the
            workers; its return value is the ``ec_connector_output`` (e.g.
            ``lambda so: worker_load(so, cache)``, or
            :func:`aggregate_ec_outputs` over several ranks' ``worker_load``).

    Raises:
        ValueError: both ``ec_connector_output`` and ``run_workers`` given.
    """
    from vllm.v1.outputs import ModelRunnerOutput

    if ec_connector_output is not None and run_workers is not None:
        raise ValueError("pass ec_connector_output or run_workers, not both")
    scheduler_output = scheduler.schedule()
    if run_workers is not None:
        ec_connector_output = run_workers(scheduler_output)
    req_ids = list(scheduler_output.num_scheduled_tokens)
    # schedule() has already advanced num_computed_tokens by this step's tokens.
    sampled = [[TEXT_TOKEN] if (req := scheduler.requests[i]).num_computed_tokens >= req.num_tokens else []
               for i in req_ids]
    engine_outputs = scheduler.update_from_output(scheduler_output, ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
        ec_connector_output=ec_connector_output,
    ))
    finished = {out.request_id: out.finish_reason for outs in engine_outputs.values() for out in outs.outputs
                if out.finish_reason is not None}
    return StepResult(scheduler_output, engine_outputs, ec_connector_output,
                      [r for r, s in zip(req_ids, sampled) if s], finished)


# ==============================
# Worker side
# ==============================

def worker_connector(cfg: VllmConfig) -> ECConnectorBase:
    """This process's worker-role connector for ``cfg``, built as vLLM's GPU worker
    builds it (``ensure_ec_transfer_initialized``), from ``get_ec_transfer()``.

    vLLM keeps one per process (one TP rank = one process): a connector built
    earlier is shut down first. Model several ranks with one Ray actor each.
    """
    from vllm.distributed.ec_transfer import ensure_ec_transfer_initialized, get_ec_transfer

    shutdown_worker_connector()
    ensure_ec_transfer_initialized(cfg)
    return get_ec_transfer()


def shutdown_worker_connector() -> None:
    """Shut down this process's worker-role connector, if any (``ensure_ec_transfer_shutdown``)."""
    from vllm.distributed.ec_transfer import ensure_ec_transfer_shutdown

    ensure_ec_transfer_shutdown()


def worker_load(scheduler_output: SchedulerOutput | StepResult, encoder_cache: dict) -> ECConnectorOutput:
    """Run the GPU model runner's EC-connector block for one step; return its ``ECConnectorOutput``.

    ``maybe_get_ec_connector_output`` binds the step's metadata, calls
    ``start_load_caches(encoder_cache)`` on a consumer (``start_save_caches`` on a
    producer), and on exit ``get_finished(finished_req_ids)``,
    ``build_connector_worker_meta()`` and ``clear_connector_metadata()``.
    ``encoder_cache`` (mm_hash -> tensor) is filled in place.

    Raises:
        RuntimeError: no worker-role connector in this process (call :func:`worker_connector`).
    """
    from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin

    if isinstance(scheduler_output, StepResult):
        scheduler_output = scheduler_output.scheduler_output
    with ECConnectorModelRunnerMixin.maybe_get_ec_connector_output(scheduler_output, encoder_cache) as output:
        pass  # the encoder and the forward would run here
    if output is None:
        raise RuntimeError("no worker-role EC connector in this process: call worker_connector(cfg) first")
    return output


def aggregate_ec_outputs(outputs: list[ECConnectorOutput | None]) -> ECConnectorOutput | None:
    """Merge TP ranks' outputs as vLLM's executor does (``ECOutputAggregator``, onto rank 0's)."""
    from vllm.distributed.ec_transfer.ec_connector.utils import ECOutputAggregator
    from vllm.v1.outputs import ModelRunnerOutput

    merged = ECOutputAggregator().aggregate(
        [ModelRunnerOutput(req_ids=[], req_id_to_index={}, ec_connector_output=o) for o in outputs])
    return merged.ec_connector_output if merged is not None else None
