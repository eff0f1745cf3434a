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

from deployments.chat_request import parse_chat_request
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


def test_a_retry_names_each_image_afresh_everywhere_it_appears():
    image = {"type": "image_url", "image_url": {"url": "https://images.example/a.png"}}
    other = {"type": "image_url", "image_url": {"url": "https://images.example/b.png"}}
    body = {"messages": [{"role": "user", "content": [image, other]}, {"role": "user", "content": [image]}]}
    chat = parse_chat_request(json.dumps(body).encode(), "http://vllm", 2)
    first = [part["uuid"] for m in chat.body["messages"] for part in m["content"]]
    assert first[0] == first[2] != first[1]

    renamed = chat.rename()
    after = [part["uuid"] for m in chat.body["messages"] for part in m["content"]]
    assert after == [renamed[first[0]], renamed[first[1]], renamed[first[0]]]
    assert not set(after) & set(first) and all(re.fullmatch(REQ_ID_PATTERN, u) for u in after)
    assert chat.req_ids == [renamed[first[0]], renamed[first[1]]]
    assert chat.items[renamed[first[1]]] == {"type": "image_url", "image_url": {"url": "https://images.example/b.png"}}
    assert chat.where[renamed[first[0]]] == "messages[0].content[0]"
    assert json.loads(chat.encoded_body())["messages"][1]["content"][0]["uuid"] == renamed[first[0]]


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
