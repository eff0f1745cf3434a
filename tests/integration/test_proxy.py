"""``EPDProxy`` in front of a stand-in vLLM server: image parts are staged under a
content-derived ``uuid`` set on the forwarded parts (a URL's by the bytes it serves, fetched
under the app's media policy), answers and streams pass through, errors keep the service's
codes.

The stand-in (``tests/standin_vllm.py``) is a real HTTP server that records every
request and answers like vLLM's OpenAI server; the TP ranks that fetch the staged
items are the session's ``RankActor``s, as vLLM's connector would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from deployments import build_proxy_app
from deployments.schemas import REQ_ID_PATTERN
from standin_vllm import CHUNKS, COMPLETION, MODELS, SSE, UPSTREAM_ERROR, StandIn, stand_in_vllm
from support import (
    DRAIN, MODEL_SPEC, data_url, deployed, image_bytes, image_item, media_server, reference_embedding, registry_stats, wait_until,
)

TP = 2


@dataclasses.dataclass
class Proxy:
    client: httpx.Client  # the proxy's routes, no API token of the epd app
    upstream: StandIn


@pytest.fixture(scope="module")
def proxy(cluster):
    with stand_in_vllm() as upstream:
        args = {
            "vllm_url": f"{upstream.url}/llm/",  # the trailing slash is stripped
            "tensor_parallel_size": TP,
            "max_request_bytes": 1024 * 1024,
            "timeout_s": 60,
        }
        serve.run(build_proxy_app(args), name="epd-proxy", route_prefix="/proxy")
        try:
            with httpx.Client(base_url=f"{cluster.url}/proxy", timeout=60) as client:
                wait_until(lambda: client.get("/v1/models").status_code == 200, 60, what="the proxy to answer")
                yield Proxy(client=client, upstream=upstream)
        finally:
            serve.delete("epd-proxy")


def image_part(data: bytes, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data), **extra}}


def chat(*parts: dict[str, Any], model: str = "stand-in", stream: bool = False) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": list(parts)}],
        "stream": stream,
    }


def release(cluster, *uuids: str) -> None:
    """Fetch every item with ranks 0..TP-1, as vLLM's connector would: releases them."""
    results = ray.get([cluster.ranks[r].fetch.remote(u, digests=True) for u in uuids for r in range(TP)])
    assert all("error" not in result for result in results), results


def entry(cluster, req_id: str) -> dict[str, Any]:
    return cluster.http.get(f"/v1/requests/{req_id}").json()


def test_image_parts_are_staged_under_deterministic_uuids(cluster, proxy):
    text = {"type": "text", "text": "What differs?"}
    a, b = image_bytes(64, 64, seed=81), image_bytes(48, 64, seed=82)
    part_a = image_part(a, detail="low")  # extra keys stay on the forwarded part, not in our item
    body = chat(text, part_a, image_part(b))
    response = proxy.client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-vllm"})
    assert response.status_code == 200, response.text
    assert response.json() == COMPLETION

    sent = proxy.upstream.chats()[-1]
    assert sent["headers"]["authorization"] == "Bearer sk-vllm"
    assert sent["json"]["messages"][0] == body["messages"][0]
    parts = sent["json"]["messages"][1]["content"]
    assert parts[0] == text
    uuid_a, uuid_b = parts[1].pop("uuid"), parts[2].pop("uuid")
    assert parts[1:] == [part_a, image_part(b)]
    assert uuid_a != uuid_b and all(re.fullmatch(REQ_ID_PATTERN, u) for u in (uuid_a, uuid_b))
    for u in (uuid_a, uuid_b):
        described = entry(cluster, u)
        assert (described["state"], described["receive_count"], len(described["items"])) == ("staged", TP, 1), described

    # The same image again while staged: the same uuid (twice in one request: once), joining the entry.
    again = proxy.client.post("/v1/chat/completions", json=chat(image_part(a), image_part(a)))
    assert again.status_code == 200, again.text
    assert [p["uuid"] for p in proxy.upstream.chats()[-1]["json"]["messages"][1]["content"]] == [uuid_a, uuid_a]
    release(cluster, uuid_a, uuid_b)
    assert entry(cluster, uuid_a)["state"] == "released"

    # And after vLLM received it: still the same uuid, forwarded (already_released is no error).
    later = proxy.client.post("/v1/chat/completions", json=chat(image_part(a)))
    assert later.status_code == 200 and later.json() == COMPLETION, later.text
    assert proxy.upstream.chats()[-1]["json"]["messages"][1]["content"][0]["uuid"] == uuid_a
    assert "authorization" not in proxy.upstream.chats()[-1]["headers"]


def url_chat(*urls: str) -> dict[str, Any]:
    return chat({"type": "text", "text": "What is it?"}, *({"type": "image_url", "image_url": {"url": u}} for u in urls))


def forwarded_images(proxy: Proxy) -> list[tuple[str, str]]:
    """(uuid, url) of each image part of the last chat vLLM received."""
    parts = proxy.upstream.chats()[-1]["json"]["messages"][1]["content"]
    return [(p["uuid"], p["image_url"]["url"]) for p in parts if p["type"] == "image_url"]


def staged_embedding(cluster, req_id: str) -> str:
    """sha256 of the one embedding staged under ``req_id``, as every rank received it (releases it)."""
    results = ray.get([cluster.ranks[r].fetch.remote(req_id, digests=True) for r in range(TP)])
    assert all("error" not in result for result in results), results
    assert len({tuple(result["bytes"]) for result in results}) == 1, results
    (digest,) = results[0]["bytes"]
    return digest


def embedding_of(image: bytes) -> str:
    return hashlib.sha256(reference_embedding(image, **MODEL_SPEC).tobytes()).hexdigest()


def test_a_url_image_is_named_by_the_content_it_serves_now(cluster, proxy):
    first, second = image_bytes(64, 48, seed=85), image_bytes(64, 48, seed=86)
    files = {"/switch.png": first}
    with media_server(files) as media:
        one = proxy.client.post("/v1/chat/completions", json=url_chat(f"{media}/switch.png"))
        assert one.status_code == 200, one.text
        ((uuid_one, sent_one),) = forwarded_images(proxy)
        files["/switch.png"] = second  # another image behind the same URL
        two = proxy.client.post("/v1/chat/completions", json=url_chat(f"{media}/switch.png"))
        assert two.status_code == 200, two.text
        ((uuid_two, sent_two),) = forwarded_images(proxy)
        # The same bytes behind another URL (and the URL twice): the same uuid, one entry.
        files["/copy.png"] = second
        three = proxy.client.post("/v1/chat/completions", json=url_chat(f"{media}/copy.png", f"{media}/copy.png"))
        assert three.status_code == 200, three.text
        copies = forwarded_images(proxy)
    assert uuid_one != uuid_two and all(re.fullmatch(REQ_ID_PATTERN, u) for u in (uuid_one, uuid_two))
    # vLLM gets exactly the bytes that were encoded, never the URL to fetch a third version.
    assert (sent_one, sent_two) == (data_url(first), data_url(second))
    assert copies == [(uuid_two, data_url(second))] * 2
    entries = [entry(cluster, u) for u in (uuid_one, uuid_two)]
    assert [(e["state"], len(e["items"])) for e in entries] == [("staged", 1)] * 2, entries
    assert entries[0]["items"][0]["mm_hash"] != entries[1]["items"][0]["mm_hash"]
    # Each entry holds its own image's embedding.
    assert staged_embedding(cluster, uuid_one) == embedding_of(first)
    assert staged_embedding(cluster, uuid_two) == embedding_of(second)


def test_a_url_the_media_policy_refuses_fails_the_chat_and_stages_nothing(cluster, proxy):
    before, accepted = len(proxy.upstream.chats()), registry_stats()["accepted_total"]
    with media_server({"/img.png": image_bytes(64, 48, seed=87)}) as media:
        # The server answers, but the app allows the host "localhost" only, not this address.
        refused = media.replace("localhost", "127.0.0.1") + "/img.png"
        response = proxy.client.post("/v1/chat/completions", json=url_chat(f"{media}/img.png", refused))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["req_id"], error
    assert error["message"].startswith("messages[1].content[2]: ") and "allowed_media_domains" in error["message"], error
    assert len(proxy.upstream.chats()) == before  # nothing forwarded
    assert registry_stats()["accepted_total"] == accepted  # nothing staged, the allowed image neither


def test_streams_pass_through_chunk_by_chunk(cluster, proxy):
    proxy.upstream.gate = threading.Event()
    received = b""
    try:
        with proxy.client.stream(
            "POST", "/v1/chat/completions", json=chat(image_part(image_bytes(64, 64, seed=83)), stream=True)
        ) as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            for chunk in response.iter_bytes():
                received += chunk
                if b"\n\n" in received:  # a whole first event: only now may the stand-in go on
                    proxy.upstream.gate.set()
    finally:
        proxy.upstream.gate.set()
        proxy.upstream.gate = None
    # The first event reached the client while the stand-in still held the rest: not buffered.
    assert proxy.upstream.gate_opened == [True]
    assert received.decode() == SSE
    events = [e for e in received.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and [json.loads(e.removeprefix("data: ")) for e in events[:-1]] == CHUNKS
    (part,) = proxy.upstream.chats()[-1]["json"]["messages"][1]["content"]
    assert entry(cluster, part["uuid"])["state"] == "staged"
    release(cluster, part["uuid"])


def test_a_bad_data_uri_fails_the_request_before_forwarding(proxy):
    before = len(proxy.upstream.chats())
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}
    response = proxy.client.post("/v1/chat/completions", json=chat({"type": "text", "text": "hi"}, bad))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and "messages[1].content[1]" in error["message"], error
    assert len(proxy.upstream.chats()) == before


def test_an_item_failing_in_the_encoder_answers_its_error(cluster, proxy):
    truncated = image_bytes(64, 64, seed=84)[:300]  # decodes in the ingress, fails in the encoder
    direct = cluster.http.post("/v1/encode", json={"items": [image_item(truncated)]})
    assert direct.status_code >= 400, direct.text
    response = proxy.client.post("/v1/chat/completions", json=chat(image_part(truncated)))
    assert response.status_code == direct.status_code, response.text
    error = response.json()["error"]
    assert error["code"] == direct.json()["error"]["code"] and error["req_id"], error
    assert entry(cluster, error["req_id"])["state"] == "failed"


@pytest.mark.parametrize(
    "content,status,code,text",
    [
        (b'{"messages": [', 422, "invalid_request", "not valid JSON"),
        (b"[" * 100_000, 422, "invalid_request", "nested too deeply"),
        (b"[1, 2]", 422, "invalid_request", "JSON object"),
        (b'{"model": "stand-in"}', 422, "invalid_request", '"messages" must be a list'),
        (b'{"messages": "hi"}', 422, "invalid_request", '"messages" must be a list'),
        (b'{"messages": [{"role": "user", "content": ["hi"]}]}', 422, "invalid_request", "messages[0].content[0]"),
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 422, "invalid_request", "image_url"),
        (b"x" * (1024 * 1024 + 1), 413, "payload_too_large", "max_request_bytes"),
    ],
    ids=["invalid JSON", "deeply nested JSON", "not an object", "no messages", "messages not a list",
         "part not an object", "image_url without url", "over max_request_bytes"],
)
def test_malformed_bodies_get_our_error_and_are_not_forwarded(proxy, content, status, code, text):
    before = len(proxy.upstream.chats())
    response = proxy.client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and text in error["message"], error
    assert len(proxy.upstream.chats()) == before


def test_upstream_errors_pass_through(proxy):
    missing = proxy.client.post("/v1/chat/completions", json=chat({"type": "text", "text": "hi"}, model="missing"))
    assert (missing.status_code, missing.json()) == (404, UPSTREAM_ERROR)
    gone = proxy.client.post("/v1/chat/completions", json=chat({"type": "text", "text": "hi"}, model="hang-up"))
    assert gone.status_code == 503, gone.text
    assert gone.json()["error"]["code"] == "unavailable"


def test_models_are_forwarded(proxy):
    response = proxy.client.get("/v1/models", headers={"Authorization": "Bearer sk-vllm"})
    assert response.status_code == 200 and response.json() == MODELS
    last = proxy.upstream.requests[-1]
    assert (last["path"], last["headers"]["authorization"]) == ("/llm/v1/models", "Bearer sk-vllm")


@pytest.mark.parametrize(
    "args,message",
    [
        ({"vllm_url": "ftp://127.0.0.1/x"}, "vllm_url: Value error, vllm_url must be an http"),
        ({"vllm_url": "http://127.0.0.1:8000/llm?x=1"}, "without query"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"vllm": "http://127.0.0.1"}, "vllm: Extra inputs are not permitted"),
    ],
)
def test_bad_proxy_args_name_the_field(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_proxy_app(args)


@serve.deployment(ray_actor_options={"num_cpus": 0}, **DRAIN)
class BuggyEncoder:
    """An encoder app with a bug: its ``encode`` raises something that is no ``RegistryError``."""

    async def encode(self, body):
        raise KeyError("a bug in the encoder app")


@pytest.fixture(scope="module")
def buggy(cluster):
    """The buggy encoder app and a proxy in front of it with local_fallback and one without
    (routes ``/proxy-wrong-on`` and ``/proxy-wrong-off``), deployed together; the stand-in vLLM."""
    with stand_in_vllm() as upstream:
        targets = [serve.RunTarget(BuggyEncoder.bind(), name="buggy-encoder", route_prefix=None)]
        for fallback in ("on", "off"):
            args = {"vllm_url": f"{upstream.url}/llm", "encoder_app": "buggy-encoder", "timeout_s": 30,
                    "local_fallback": fallback == "on"}
            targets.append(serve.RunTarget(build_proxy_app(args), name=f"epd-proxy-wrong-{fallback}",
                                           route_prefix=f"/proxy-wrong-{fallback}"))
        with deployed(*targets):
            yield upstream


@pytest.mark.parametrize("local_fallback", [False, True], ids=["without local_fallback", "with local_fallback"])
def test_a_bug_calling_the_encoder_app_is_a_500_not_a_retryable_503(cluster, buggy, local_fallback):
    """Without local_fallback the chat fails with 500 (not 503: retrying will not help); with
    it (the default) vLLM encodes the image itself and the chat gets its answer."""
    chats_before = len(buggy.chats())
    with httpx.Client(base_url=f"{cluster.url}/proxy-wrong-{'on' if local_fallback else 'off'}", timeout=60) as client:
        wait_until(lambda: client.get("/v1/models").status_code == 200, 60, what="the proxy to answer")
        image = {"type": "image_url", "image_url": {"url": data_url(image_bytes(64, 64, seed=9901))}}
        response = client.post("/v1/chat/completions", json=chat(image))
    if local_fallback:
        assert (response.status_code, response.json()) == (200, COMPLETION), response.text
        assert buggy.chats()[-1]["json"]["messages"][1]["content"][0]["uuid"]
    else:
        assert response.status_code == 500, response.text
        assert response.json()["error"]["code"] == "internal" and "Retry-After" not in response.headers
        assert len(buggy.chats()) == chats_before
