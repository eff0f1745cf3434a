"""``EPDProxy``'s decisions that need no server: what each item error does to the chat,
which stream events may still be retried, and how a retry renames a chat's images; and
which cluster an engine process started by a Ray worker joins."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from deployments.chat_request import content_uuid, fetched_uuid, parse_chat_request
from deployments.proxy import ITEM_ERROR_ACTIONS
from deployments.schemas import REQ_ID_PATTERN
from deployments.upstream import _event_verdict
from registry.errors import HTTP_STATUS, RegistryError
from registry.engines.vllm.finder import cluster_address
from support import wait_until


def test_every_error_code_has_an_action_and_only_client_mistakes_fail_the_chat():
    assert set(ITEM_ERROR_ACTIONS) == set(HTTP_STATUS) | {RegistryError.code}
    assert set(ITEM_ERROR_ACTIONS.values()) == {"fail", "forward", "fallback"}
    failing = {code for code, action in ITEM_ERROR_ACTIONS.items() if action == "fail"}
    assert failing == {"invalid_request", "payload_too_large", "conflict", "unauthorized", "invalid_rank"}
    assert all(HTTP_STATUS[code] < 500 and code != "overloaded" for code in failing)


def event(body) -> bytes:
    return f"data: {json.dumps(body)}".encode()


@pytest.mark.parametrize(
    "raw, verdict",
    [
        (event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}), "preamble"),
        (b": keep-alive", "preamble"),
        (event({"choices": [{"index": 0, "delta": {"content": "t5"}, "finish_reason": None}]}), "output"),
        (event({"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "x"}]}}]}), "output"),
        (event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), "output"),
        (event({"choices": [], "usage": {"prompt_tokens": 3}}), "output"),
        (event({"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}),
         "failure:[500] Internal server error"),
        (event({"error": {"message": "bad", "type": "BadRequestError", "code": 400}}), "output"),
        (b"data: [DONE]", "output"),
        (b"data: not json", "output"),
    ],
    ids=["role only", "comment", "content", "tool call", "finish", "usage", "5xx error", "4xx error", "done", "not json"],
)
def test_stream_events_that_hold_or_commit_the_relay(raw, verdict):
    assert _event_verdict(raw) == verdict


A_URI, B_URI = "data:image/png;base64,QUFB", "data:image/png;base64,QkJC"


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_retry_names_each_image_afresh_everywhere_it_appears():
    body = {"messages": [{"role": "user", "content": [image(A_URI), image(B_URI), image("https://images.example/c.png")]},
                         {"role": "user", "content": [image(A_URI)]}]}
    chat = parse_chat_request(json.dumps(body).encode(), "http://vllm", 2)
    (url_name,) = chat.urls
    chat.name_fetched(url_name, fetched_uuid("http://vllm", 2, "c" * 32), "data:image/png;base64,Q0ND", {"type": "image_ref"})
    first = [part["uuid"] for m in chat.body["messages"] for part in m["content"]]
    assert first[0] == first[3] != first[1]

    renamed = chat.rename()
    after = [part["uuid"] for m in chat.body["messages"] for part in m["content"]]
    assert after == [renamed[first[0]], renamed[first[1]], renamed[first[2]], renamed[first[0]]]
    assert not set(after) & set(first) and all(re.fullmatch(REQ_ID_PATTERN, u) for u in after)
    assert chat.req_ids == [renamed[first[0]], renamed[first[1]], renamed[first[2]]]
    assert chat.items[renamed[first[1]]] == image(B_URI)
    assert chat.items[renamed[first[2]]] == {"type": "image_ref"}
    assert chat.where[renamed[first[0]]] == "messages[0].content[0]"
    assert json.loads(chat.encoded_body())["messages"][1]["content"][0]["uuid"] == renamed[first[0]]


def test_a_url_image_is_named_by_its_fetched_bytes_not_by_its_url():
    url, other = "https://images.example/a.png", "file:///media/b.png"
    body = {"messages": [{"role": "user", "content": [image(url), image(other), image(url)]}]}
    parse = lambda: parse_chat_request(json.dumps(body).encode(), "http://vllm", 2)  # noqa: E731
    chat, again = parse(), parse()
    parts = chat.body["messages"][0]["content"]
    # Until fetched: a random name per distinct URL, nothing to encode, the URL untouched.
    assert parts[0]["uuid"] == parts[2]["uuid"] != parts[1]["uuid"] and not chat.items
    assert chat.urls == {parts[0]["uuid"]: url, parts[1]["uuid"]: other}
    assert not set(chat.urls) & set(again.urls)  # a URL's text names nothing across requests
    # Fetched: named by the digest of the bytes; two URLs with the same bytes share one name.
    named = fetched_uuid("http://vllm", 2, "d" * 32)
    for name in list(chat.urls):
        chat.name_fetched(name, named, "data:image/png;base64,QUFB", {"type": "image_ref"})
    assert [p["uuid"] for p in parts] == [named] * 3 and chat.req_ids == [named] and not chat.urls
    assert [p["image_url"]["url"] for p in parts] == ["data:image/png;base64,QUFB"] * 3
    assert chat.where == {named: "messages[0].content[0]"}
    # The same bytes, the same name, for this vLLM instance and TP size only; other bytes, another.
    assert fetched_uuid("http://vllm", 2, "d" * 32) == named and re.fullmatch(REQ_ID_PATTERN, named)
    assert len({named, fetched_uuid("http://vllm", 2, "e" * 32), fetched_uuid("http://vllm", 1, "d" * 32),
                fetched_uuid("http://other", 2, "d" * 32)}) == 4
    # A data: URI is named by its text at once, as before.
    (data_part,) = parse_chat_request(json.dumps({"messages": [{"role": "user", "content": [image(A_URI)]}]}).encode(),
                                      "http://vllm", 2).body["messages"][0]["content"]
    assert data_part["uuid"] == content_uuid("http://vllm", 2, A_URI)


@pytest.fixture
def raylet():
    """A process whose command line names a GCS address, as a raylet's does."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--gcs-address=10.1.2.3:6379"])
    # Until the child has exec'd, /proc shows the parent's command line: wait for its own.
    cmdline = pathlib.Path(f"/proc/{proc.pid}/cmdline")
    wait_until(lambda: b"--gcs-address=10.1.2.3:6379" in cmdline.read_bytes(), 30, what="the child's command line")
    yield proc
    proc.kill()
    proc.wait()


def test_auto_under_a_ray_worker_is_that_worker_s_cluster(monkeypatch, raylet):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_RAYLET_PID", str(raylet.pid))
    assert cluster_address("auto") == "10.1.2.3:6379"
    assert cluster_address("10.9.9.9:6379") == "10.9.9.9:6379"  # an address given is kept
    monkeypatch.setenv("RAY_ADDRESS", "10.8.8.8:6379")
    assert cluster_address("auto") == "auto"  # ray.init takes RAY_ADDRESS itself


def test_auto_elsewhere_is_left_to_ray(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    assert cluster_address("auto") == "auto"
    monkeypatch.setenv("RAY_RAYLET_PID", "999999999")  # gone
    assert cluster_address("auto") == "auto"
