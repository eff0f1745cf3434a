"""``EPDProxy`` when the encoder service fails: the chat still gets vLLM's answer (vLLM encodes
the item itself), a client's bad image still fails it, and a chat vLLM fails after
accepting it is sent once more.

The encoder app here is scripted: a real Serve app whose ``fetch_media``, ``encode`` and
``describe`` answer by the image URL's file name (``fetch-unavailable.png`` cannot be
fetched, ``submit-overloaded.png`` is refused as overloaded, ``ends-failed.png`` is accepted
and then ends failed, ...), so each decision of the proxy is driven exactly. A fetched
image's bytes are its file name. vLLM is the stand-in of ``tests/standin_vllm.py``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import re
from typing import Any

import httpx
import pytest
from ray import serve

from deployments import build_proxy_app
from deployments.schemas import REQ_ID_PATTERN
from registry.errors import InvalidRequest, Overloaded, Unavailable, UnknownRequest
from registry.logs import quiet_client_errors
from standin_vllm import COMPLETION, FAILED_AFTER_OUTPUT_SSE, GENERATION_ERROR, SSE, StandIn, stand_in_vllm
from support import DRAIN, deployed, log_lines_since, log_offsets, wait_until

ENCODER_APP = "scripted-encoder"
# The scripted outcomes: file name -> (status, code) of the chat without local_fallback.
SERVICE_FAILURES = {
    "fetch-unavailable.png": (503, "unavailable"),  # the service could not be asked to fetch it
    "submit-overloaded.png": (429, "overloaded"),
    "submit-unavailable.png": (503, "unavailable"),
    "ends-failed.png": (500, "encode_failed"),
    "ends-expired.png": (410, "expired"),
    "ends-cancelled.png": (410, "cancelled"),
    "lost.png": (404, "unknown_request"),  # its registry shard restarted: the entry is gone
    "registry-down.png": (503, "unavailable"),  # its registry shard does not answer
}
_ENDED = {
    "ends-failed.png": {"state": "failed", "error": {"code": "encode_failed", "message": "items[0]: RuntimeError: out of memory"}},
    "ends-invalid.png": {"state": "failed", "error": {"code": "invalid_request", "message": "items[0]: the image is truncated"}},
    "ends-expired.png": {"state": "expired"},
    "ends-cancelled.png": {"state": "cancelled"},
}


@serve.deployment(ray_actor_options={"num_cpus": 0}, **DRAIN)
class ScriptedEncoder:
    """The encoder app's ``encode``/``describe``, answering by the image's file name."""

    def __init__(self):
        quiet_client_errors()  # as the real app: its RegistryErrors are answers, not tracebacks
        self._names: dict[str, str] = {}
        self._submitted: list[str] = []

    async def fetch_media(self, item: dict[str, Any], req_id: str) -> dict[str, Any]:
        name = item["image_url"]["url"].rsplit("/", 1)[-1]
        if name == "fetch-unavailable.png":
            raise Unavailable("the registry actor is not reachable; retry shortly", req_id)
        if name == "fetch-invalid.png":
            raise InvalidRequest("items[0]: could not fetch https://images.example/fetch-invalid.png", req_id)
        return {"digest": hashlib.blake2b(name.encode(), digest_size=16).hexdigest(), "media_type": "image/png",
                "data": name.encode()}

    async def encode(self, body: dict[str, Any]) -> dict[str, Any]:
        req_id, name = body["req_id"], (await body["items"][0]["image_ref"]).decode()
        self._submitted.append(req_id)
        if name == "submit-overloaded.png":
            raise Overloaded("the encoder queue is full; retry later", req_id)
        if name == "submit-unavailable.png":
            raise Unavailable("the registry actor is not reachable; retry shortly", req_id)
        if name == "submit-invalid.png":
            raise InvalidRequest("items[0]: fetching the image failed: 404 Not Found", req_id)
        self._names[req_id] = name
        return {"req_id": req_id, "state": "pending"}

    async def describe(self, req_id: str, wait_s: float) -> dict[str, Any]:
        name = self._names[req_id]
        if name == "lost.png":
            raise UnknownRequest(f"no request with req_id {req_id}", req_id)
        if name == "registry-down.png":
            raise Unavailable("the registry actor is not reachable; retry shortly", req_id)
        return {"req_id": req_id, **_ENDED.get(name, {"state": "staged"})}

    async def submitted(self) -> list[str]:
        return list(self._submitted)


@dataclasses.dataclass
class Proxies:
    fallback: httpx.Client  # local_fallback: true (the default)
    strict: httpx.Client  # local_fallback: false
    upstream: StandIn
    encoder: Any


@pytest.fixture(scope="module")
def proxies(cluster):
    with stand_in_vllm() as upstream:
        common = {"vllm_url": f"{upstream.url}/llm", "encoder_app": ENCODER_APP, "timeout_s": 30}
        with deployed(
            serve.RunTarget(ScriptedEncoder.bind(), name=ENCODER_APP, route_prefix=None),
            serve.RunTarget(build_proxy_app(common), name="proxy-fallback", route_prefix="/proxy-fallback"),
            serve.RunTarget(build_proxy_app({**common, "local_fallback": False}), name="proxy-strict",
                            route_prefix="/proxy-strict"),
        ) as (encoder, _, _), httpx.Client(base_url=f"{cluster.url}/proxy-fallback", timeout=60) as fallback, \
                httpx.Client(base_url=f"{cluster.url}/proxy-strict", timeout=60) as strict:
            for client in (fallback, strict):
                wait_until(lambda: client.get("/v1/models").status_code == 200, 60, what="the proxy to answer")
            yield Proxies(fallback, strict, upstream, encoder)


def chat(name: str, stream: bool = False) -> dict[str, Any]:
    image = {"type": "image_url", "image_url": {"url": f"https://images.example/{name}"}}
    return {"model": "stand-in", "stream": stream,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]}


def forwarded_uuid(upstream: StandIn, index: int = -1) -> str:
    return upstream.chats()[index]["json"]["messages"][0]["content"][1]["uuid"]


def lines_with(text: str, offsets: dict[str, int]) -> list[str]:
    """Distinct log records containing ``text``, each once (a replica's line is in two of its
    files, its Serve log and its worker's stderr, with different prefixes)."""
    records = {line.split(" -- ", 1)[-1]: line for lines in log_lines_since(offsets).values() for line in lines if text in line}
    return [records[record] for record in sorted(records)]


@pytest.mark.parametrize("name", list(SERVICE_FAILURES))
def test_a_failing_service_degrades_to_vllm_encoding_the_image(proxies, name):
    offsets = log_offsets()
    before = len(proxies.upstream.chats())
    response = proxies.fallback.post("/v1/chat/completions", json=chat(name))
    assert (response.status_code, response.json()) == (200, COMPLETION), response.text
    assert len(proxies.upstream.chats()) == before + 1
    req_id = forwarded_uuid(proxies.upstream)  # forwarded with its uuid: vLLM finds no entry and encodes it
    forwarded = proxies.upstream.chats()[-1]["json"]["messages"][0]["content"][1]["image_url"]["url"]
    if name.startswith("fetch-"):  # not fetched: as it came, for vLLM to fetch
        assert forwarded == chat(name)["messages"][0]["content"][1]["image_url"]["url"]
    else:  # the bytes the service fetched, as a data: URI
        assert forwarded == f"data:image/png;base64,{base64.b64encode(name.encode()).decode()}"
    code = SERVICE_FAILURES[name][1]
    found = wait_until(lambda: lines_with(f"req_id={req_id}: ", offsets), 20, what=f"the line about {req_id}")
    assert len(found) == 1 and f"[{code}]" in found[0] and found[0].rstrip().endswith("vLLM encodes it itself"), found
    assert "WARNING" in found[0].split(" -- ")[0], found
    assert not lines_with("Traceback", offsets)


@pytest.mark.parametrize("name", list(SERVICE_FAILURES))
def test_without_local_fallback_the_item_s_error_fails_the_chat(proxies, name):
    before = len(proxies.upstream.chats())
    response = proxies.strict.post("/v1/chat/completions", json=chat(name))
    status, code = SERVICE_FAILURES[name]
    assert (response.status_code, response.json()["error"]["code"]) == (status, code), response.text
    if name.startswith(("fetch-", "submit-")):
        assert len(proxies.upstream.chats()) == before  # refused before anything was forwarded


@pytest.mark.parametrize("name, where", [("fetch-invalid.png", "fetch"), ("submit-invalid.png", "submit"),
                                         ("ends-invalid.png", "encode")])
def test_a_client_s_bad_image_fails_the_chat_either_way(proxies, name, where):
    offsets = log_offsets()
    response = proxies.fallback.post("/v1/chat/completions", json=chat(name))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["message"].startswith("messages[0].content[1]: "), error
    # Logged as the client's mistake: INFO, no traceback.
    found = wait_until(lambda: lines_with(f"req_id={error['req_id']} ", offsets), 20, what="the refusal's line")
    assert len(found) == 1 and "INFO" in found[0].split(" -- ")[0], found
    assert not lines_with("Traceback", offsets)


def test_a_chat_vllm_fails_is_retried_once_with_its_images_named_afresh(proxies):
    offsets = log_offsets()
    before = len(proxies.upstream.chats())
    proxies.upstream.fail_next = 1
    response = proxies.fallback.post("/v1/chat/completions", json=chat("staged.png"))
    assert (response.status_code, response.json()) == (200, COMPLETION), response.text
    assert len(proxies.upstream.chats()) == before + 2
    first, second = forwarded_uuid(proxies.upstream, -2), forwarded_uuid(proxies.upstream, -1)
    assert first != second and re.fullmatch(REQ_ID_PATTERN, second)
    submitted = proxies.encoder.submitted.remote().result()
    assert submitted[-2:] == [first, second]  # staged again under the new name
    found = wait_until(lambda: lines_with("retrying it once", offsets), 20, what="the retry's line")
    assert len(found) == 1 and first in found[0] and second in found[0] and "500" in found[0], found


def test_a_second_failure_is_relayed_as_vllm_answered_it(proxies):
    before = len(proxies.upstream.chats())
    proxies.upstream.fail_next = 2
    response = proxies.fallback.post("/v1/chat/completions", json=chat("staged.png"))
    assert (response.status_code, response.json()) == (500, GENERATION_ERROR), response.text
    assert len(proxies.upstream.chats()) == before + 2


def test_a_stream_that_failed_before_any_output_is_retried(proxies):
    before = len(proxies.upstream.chats())
    proxies.upstream.fail_next = 1
    with proxies.fallback.stream("POST", "/v1/chat/completions", json=chat("staged.png", stream=True)) as response:
        assert response.status_code == 200
        received = response.read().decode()
    assert received == SSE  # the client saw nothing of the failed attempt
    assert len(proxies.upstream.chats()) == before + 2


def test_a_stream_that_failed_after_output_is_relayed_as_is(proxies):
    before = len(proxies.upstream.chats())
    proxies.upstream.fail_next, proxies.upstream.fail_after_output = 1, True
    try:
        with proxies.fallback.stream("POST", "/v1/chat/completions", json=chat("staged.png", stream=True)) as response:
            assert response.status_code == 200
            received = response.read().decode()
    finally:
        proxies.upstream.fail_after_output = False
    assert received == FAILED_AFTER_OUTPUT_SSE  # output reached the client: no retry
    assert len(proxies.upstream.chats()) == before + 1
