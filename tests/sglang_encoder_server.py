"""SGLang 0.5.23's own EPD encoder HTTP server on a CPU, with a fixed tensor for the vision forward.

Run with the SGLang venv's python (``tests/sglang_env.py``)::

    python tests/sglang_encoder_server.py --port 30100 --tokens 64 --hidden 2048 --dtype bfloat16 \\
        --backend zmq_to_scheduler

It prints one JSON line ``{"ready": true, "url": "http://127.0.0.1:30100", ...}``
once uvicorn is serving, then serves until killed (SIGTERM/SIGINT).

Everything on the request path is SGLang's: the FastAPI app and its route
handlers (``sglang/srt/disaggregation/encoder/http_server.py``: ``/encode``,
``/scheduler_receive_url``, ``/health``), its ``EncoderScheduler`` batching and
``execute_encode_pipeline`` (``runtime.py``), and ``MMEncoder``'s encode,
staging, destination registry and ZMQ sending (``server.py``: ``batch_encode``,
``_prepare_encode_context``, ``_compute_direct_embedding``, ``_stage_embeddings``,
``_stage_errors``, ``send_with_url``/``send``, ``_send``). Two things stand in:

* ``MMEncoder.__init__`` is not run (it loads a model on a GPU): the instance is
  built with ``__new__`` and given the attributes ``__init__`` gives a rank-0,
  TP=1, non-mooncake encoder (``server.py:536-724``), including a real one-rank
  gloo TP group built with SGLang's ``init_distributed_environment`` and
  ``initialize_model_parallel`` as ``__init__`` does.
* The preprocessor and the model: ``process_batch_mm_items`` returns, per image,
  a grid ``[1, 2a, 2b]`` with ``a*b == --tokens`` (Qwen2-VL: tokens = t*h*w/2**2)
  and a tiny ``pixel_values``; the model's ``get_image_feature`` returns, per
  image, one fixed ``[--tokens, --hidden]`` tensor of ``--dtype`` (seeded
  normal values). A part with n images carries n copies, in order.

Errors: with ``--fail-substring S`` an image whose URL contains S fails in
preprocessing with ``ValueError``, which SGLang turns into its own 400
(``Failed to process mm items: ...``), an error ``EmbeddingData`` staged for the
part, a one-frame error message pushed to every registered receiver, and an
error answer to ``/encode``.

``--backend`` must match the receivers': SGLang's encoder reads the backend from
its own ``--encoder-transfer-backend`` (``runtime.py:_push_embedding_to_prefill``);
a ``zmq_to_scheduler`` encoder given a ``zmq_to_tokenizer`` request (an integer
``embedding_port``) fails its ``assert isinstance(ports, list)``.

Options: ``--mark-items`` makes each image's tensor distinct (row 0 is set from
the sha256 of the image's URL; costs one copy per image), so a receiver that
mixes up parts or items is caught.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile

_DTYPES = ("bfloat16", "float16", "float32")


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: pick a free port (printed in the ready line)")
    parser.add_argument("--tokens", type=int, default=64, help="embedding rows per image")
    parser.add_argument("--hidden", type=int, default=2048, help="embedding width")
    parser.add_argument("--dtype", choices=_DTYPES, default="bfloat16")
    parser.add_argument("--backend", choices=("zmq_to_scheduler", "zmq_to_tokenizer"), default="zmq_to_scheduler")
    parser.add_argument("--fail-substring", default=None,
                        help="an image whose URL contains this fails in preprocessing (SGLang's 400 path)")
    parser.add_argument("--mark-items", action="store_true", help="make each image's tensor distinct")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="warning", help="uvicorn's and SGLang's log level")
    return parser.parse_args(argv)


def _grid_for(tokens: int) -> list[int]:
    """``[1, 2a, 2b]`` with ``a*b == tokens`` and ``a`` the largest divisor not above sqrt(tokens)."""
    a = max(d for d in range(1, int(tokens**0.5) + 1) if tokens % d == 0)
    return [1, 2 * a, 2 * (tokens // a)]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _item_url(item) -> str:
    return item.get("url", "") if isinstance(item, dict) else str(item)


def main(argv=None) -> None:
    args = _parse_args(argv)
    if args.tokens <= 0 or args.hidden <= 0:
        sys.exit("--tokens and --hidden must be positive")
    port = args.port or _free_port(args.host)

    import sglang_env  # tests/ is sys.path[0] when run as a script

    model_dir = sglang_env.write_tiny_qwen2_vl_config(tempfile.mkdtemp(prefix="sglang-encoder-model-"))

    import concurrent.futures
    import logging

    import sglang.srt.disaggregation.encoder.http_server as http_server
    import sglang.srt.disaggregation.encoder.server as server_module
    import torch
    import uvicorn
    import zmq
    import zmq.asyncio
    from sglang.srt.disaggregation.encoder.preprocessor import EncoderPreprocessResult
    from sglang.srt.disaggregation.encoder.runtime import (
        EncoderRuntime,
        EncoderScheduler,
        _resolve_encoder_batch_policy,
    )
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.environ import envs
    from sglang.srt.managers.schedule_batch import Modality
    from sglang.srt.runtime_context import get_disagg, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    dtype = getattr(torch, args.dtype)
    grid = _grid_for(args.tokens)
    patches_per_image = grid[0] * grid[1] * grid[2]
    generator = torch.Generator().manual_seed(args.seed)
    base = torch.randn(args.tokens, args.hidden, generator=generator, dtype=torch.float32).to(dtype).contiguous()

    class FixedPreprocessor:
        """Stands in for ``EncoderPreprocessor``: a fixed grid per image, no decoding."""

        def supports_modality(self, modality):
            return modality == Modality.IMAGE

        def get_num_patches(self, grid_row, modality):  # as EncoderPreprocessor.get_num_patches for images
            return int(grid_row[0] * grid_row[1] * grid_row[2])

        async def process_batch_mm_items(self, requests, modality):
            if modality != Modality.IMAGE:
                raise NotImplementedError(f"this stand-in encodes images only, not {modality.name}")
            urls, items_per_req = [], []
            for req in requests:
                items = req["mm_items"] if isinstance(req["mm_items"], (list, tuple)) else [req["mm_items"]]
                urls += [_item_url(item) for item in items]
                items_per_req.append(len(items))
            if args.fail_substring is not None and any(args.fail_substring in url for url in urls):
                raise ValueError(f"image rejected by --fail-substring {args.fail_substring!r}")
            # One patch row per image carries the image's identity for --mark-items; the rest is zeros.
            pixel_values = torch.zeros(len(urls) * patches_per_image, 1, dtype=torch.float32)
            for i, url in enumerate(urls):
                pixel_values[i * patches_per_image, 0] = int(hashlib.sha256(url.encode()).hexdigest()[:6], 16)
            grid_thw = torch.tensor([grid] * len(urls), dtype=torch.int64)
            result = EncoderPreprocessResult(
                mm_inputs={"pixel_values": pixel_values, "image_grid_thw": grid_thw},
                grid_thw=grid_thw, token_counts=[args.tokens] * len(urls))
            return result, items_per_req

    class FixedModel:
        """Stands in for the vision tower: ``get_image_feature`` returns the fixed tensor per image."""

        def get_image_feature(self, mm_items):
            pixel_values = torch.cat([item.feature for item in mm_items])
            n_images = pixel_values.shape[0] // patches_per_image
            if not args.mark_items:
                return base if n_images == 1 else base.repeat(n_images, 1)
            out = base.repeat(n_images, 1)
            for i in range(n_images):
                out[i * args.tokens, :] = float(pixel_values[i * patches_per_image, 0]) / 2**24
            return out

    model_type = "qwen2_vl"
    server_args = ServerArgs(model_path=model_dir, encoder_only=True, encoder_transfer_backend=args.backend,
                             device="cpu", host=args.host, port=port, skip_tokenizer_init=True,
                             log_level=args.log_level)
    publish(server_args, role="encoder")  # as http_server.launch_server does

    # MMEncoder.__init__ (server.py:588-615) builds its TP group; a one-rank gloo group here.
    init_distributed_environment(backend="gloo", world_size=1, rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{_free_port('127.0.0.1')}", local_rank=0)
    get_parallel().override_permanently(
        tp_rank=0, pp_size=1, pp_rank=0, attn_dp_size=1, attn_dp_rank=0, attn_tp_size=1, attn_tp_rank=0,
        attn_cp_rank=0, attn_dcp_size=1, moe_ep_size=1, moe_ep_rank=0, moe_dp_size=1, moe_tp_size=1)
    initialize_model_parallel()

    # The rest of MMEncoder.__init__ for rank 0, TP=1, a zmq backend, no global cache (server.py:559-724).
    encoder = server_module.MMEncoder.__new__(server_module.MMEncoder)
    encoder.server_args = server_args
    encoder.transfer_backend = get_disagg().encoder_transfer_backend
    encoder.use_mooncake = False
    encoder.rank = 0
    encoder.dp_rank = 0
    encoder.profiler = None
    encoder.model_type = model_type
    encoder.device = "cpu"
    encoder.gpu_id = 0
    encoder.model = FixedModel()
    encoder.preprocessor = FixedPreprocessor()
    encoder.context = zmq.asyncio.Context(2)
    encoder.sync_context = zmq.Context()
    encoder.scheduler_send_sockets = {}
    encoder.scheduler_send_locks = {}
    encoder.executor = concurrent.futures.ThreadPoolExecutor(max_workers=10)
    encoder.mm_cache = None  # only used with --enable-prefix-mm-cache (off)
    encoder.mm_cache_lock = asyncio.Lock()
    encoder.send_timeout = envs.SGLANG_ENCODER_SEND_TIMEOUT.get()
    encoder.background_tasks = set()
    encoder._embedding_dtype = dtype
    encoder._element_size = base.element_size()
    encoder._embedding_dims = {Modality.IMAGE: args.hidden, Modality.VIDEO: args.hidden, Modality.AUDIO: args.hidden}
    encoder.mm_global_cache = None
    encoder.req_states = {}
    encoder.abandoned_req_ids = set()
    encoder.encode_dispatch_lock = asyncio.Lock()
    encoder.delivery = server_module.ZmqDelivery(
        encoder, cleanup_receive_state=get_disagg().encoder_transfer_backend == "zmq_to_scheduler")

    # launch_local_runtime (runtime.py:1741-1816) with no TP followers.
    max_batch_size, coalesce_same_turn = _resolve_encoder_batch_policy(
        model_type, server_module.ENCODER_MAX_BATCH_SIZE, server_module.ENCODER_MAX_BATCH_SIZE_EXPLICIT)
    scheduler = EncoderScheduler(encoder, [], max_batch_size=max_batch_size, coalesce_same_turn=coalesce_same_turn)
    runtime = EncoderRuntime(encoder=encoder, scheduler=scheduler, send_sockets=[], zmq_context=zmq.Context(),
                             tp_processes=[])
    http_server.local_runtime = runtime
    http_server.encoder = encoder
    http_server.encoder_scheduler = scheduler
    http_server.send_sockets = []

    logging.getLogger("sglang").setLevel(args.log_level.upper())
    config = uvicorn.Config(http_server.app, host=args.host, port=port, log_level=args.log_level, access_log=False)
    server = uvicorn.Server(config)

    async def serve():
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                await task
                raise SystemExit("uvicorn stopped before serving")
            await asyncio.sleep(0.01)
        print(json.dumps({
            "ready": True, "url": f"http://{args.host}:{port}", "pid": os.getpid(), "backend": args.backend,
            "tokens": args.tokens, "hidden": args.hidden, "dtype": args.dtype, "grid_thw": grid,
            "bytes_per_image": base.numel() * base.element_size(), "max_batch_size": max_batch_size,
            "sha256_per_image": None if args.mark_items else hashlib.sha256(_raw(base)).hexdigest(),
        }), flush=True)
        # SGLang read the config at publish; uvicorn re-raises SIGTERM after its shutdown, so no
        # `finally` would run: remove the folder now.
        shutil.rmtree(model_dir, ignore_errors=True)
        await task

    try:
        asyncio.run(serve())  # until SIGTERM/SIGINT (uvicorn shuts down gracefully)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def _raw(tensor) -> bytes:
    import torch

    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.contiguous().numpy().tobytes()


if __name__ == "__main__":
    main()
