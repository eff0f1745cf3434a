"""Reading a request body (``deployments.http_api.read_json``): past ``PARSE_OFF_LOOP_BYTES`` it
is parsed on a worker thread, not on the replica's event loop (parsing tens of MB takes a
tenth of a second, which held up every other request of the replica); the limit is checked
before anything is buffered. A real Starlette request over an ASGI receive channel."""

import asyncio
import json
import threading

import pytest
from starlette.requests import Request

from deployments import http_api
from registry.errors import InvalidRequest, PayloadTooLarge


def _request(body: bytes, chunk: int = 64 * 1024) -> Request:
    chunks = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]

    async def receive():
        data = chunks.pop(0)
        return {"type": "http.request", "body": data, "more_body": bool(chunks)}

    return Request({"type": "http", "method": "POST", "headers": [], "path": "/"}, receive)


@pytest.fixture
def parsed_on(monkeypatch):
    """The thread each ``parse_json`` call ran on."""
    threads = []
    parse = http_api.parse_json

    def recording(raw):
        threads.append(threading.current_thread())
        return parse(raw)

    monkeypatch.setattr(http_api, "parse_json", recording)
    return threads


def test_a_small_body_is_parsed_on_the_event_loop_and_a_large_one_on_a_worker_thread(parsed_on):
    small = json.dumps({"items": ["x" * 1000]}).encode()
    large = json.dumps({"items": ["x" * (http_api.PARSE_OFF_LOOP_BYTES + 10)]}).encode()

    async def both():
        loop_thread = threading.current_thread()
        assert await http_api.read_json(_request(small), 64 << 20) == {"items": ["x" * 1000]}
        assert (await http_api.read_json(_request(large), 64 << 20))["items"][0][:3] == "xxx"
        return loop_thread

    loop_thread = asyncio.run(both())
    assert parsed_on[0] is loop_thread and parsed_on[1] is not loop_thread


def test_bad_json_and_an_oversized_body_are_refused_with_their_codes(parsed_on):
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        asyncio.run(http_api.read_json(_request(b"{" + b" " * (http_api.PARSE_OFF_LOOP_BYTES + 1)), 64 << 20))
    with pytest.raises(PayloadTooLarge, match="max_request_bytes"):
        asyncio.run(http_api.read_json(_request(b"[" + b"0," * 1000 + b"0]"), 100))
    assert len(parsed_on) == 1  # the oversized body was never parsed
