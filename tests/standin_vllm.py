"""A stand-in for vLLM's OpenAI server, for tests of ``EPDProxy``: a real HTTP server (a
thread of the test process, under the path prefix ``/llm``) that records every request
and answers as vLLM does, failures included.

``fail_next = n`` makes the next ``n`` chat requests fail as vLLM fails a request it
accepted (a worker could not load a staged item): a 500 JSON body, or for a stream a
role-only chunk, then ``data: {"error": {..., "code": 500}}`` and ``[DONE]``. With
``fail_after_output`` a stream sends its first content chunk before that error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import threading
from typing import Any

MODELS = {"object": "list", "data": [{"id": "stand-in", "object": "model", "owned_by": "vllm"}]}
COMPLETION = {
    "id": "chatcmpl-standin",
    "object": "chat.completion",
    "model": "stand-in",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "two images"}, "finish_reason": "stop"}],
}
CHUNKS = [
    {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": word}}]}
    for word in ("one ", "two ", "three")
]
SSE = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in CHUNKS) + "data: [DONE]\n\n"
UPSTREAM_ERROR = {"error": {"message": "The model `missing` does not exist.", "type": "NotFoundError", "code": 404}}
# vLLM's answer to a request that failed during generation (GenerationError).
GENERATION_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}
ROLE_CHUNK = {"id": "chatcmpl-standin", "object": "chat.completion.chunk",
              "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
FAILED_SSE = f"data: {json.dumps(ROLE_CHUNK)}\n\ndata: {json.dumps(GENERATION_ERROR)}\n\ndata: [DONE]\n\n"
FAILED_AFTER_OUTPUT_SSE = (
    f"data: {json.dumps(ROLE_CHUNK)}\n\ndata: {json.dumps(CHUNKS[0])}\n\n"
    f"data: {json.dumps(GENERATION_ERROR)}\n\ndata: [DONE]\n\n"
)


@dataclasses.dataclass
class StandIn:
    """What the stand-in vLLM server saw, and the switches that change its answers."""

    url: str
    requests: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    gate: threading.Event | None = None  # set: a stream waits for it after its first chunk
    gate_opened: list[bool] = dataclasses.field(default_factory=list)  # per held stream: opened in time
    fail_next: int = 0  # the next chat requests that fail as vLLM fails an accepted request
    fail_after_output: bool = False  # a failing stream sends output before its error
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def chats(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["path"] == "/llm/v1/chat/completions"]

    def take_failure(self) -> bool:
        with self.lock:
            if self.fail_next <= 0:
                return False
            self.fail_next -= 1
            return True


@contextlib.contextmanager
def stand_in_vllm():
    """A vLLM-like OpenAI server on 127.0.0.1, under the path prefix ``/llm``."""
    state = StandIn(url="")

    class Handler(http.server.BaseHTTPRequestHandler):
        def _record(self, body: Any) -> None:
            state.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "json": body})

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _stream(self, events: list[str]) -> None:
            # HTTP/1.0 without Content-Length: the stream ends when the connection closes.
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for n, event in enumerate(events):
                self.wfile.write(f"{event}\n\n".encode())
                self.wfile.flush()
                if n == 0 and state.gate is not None:
                    state.gate_opened.append(state.gate.wait(10))

        def do_GET(self):  # noqa: N802 - the stdlib's name
            self._record(None)
            if self.path == "/llm/v1/models":
                self._send(200, json.dumps(MODELS).encode(), "application/json")
            else:
                self._send(404, b'{"detail": "Not Found"}', "application/json")

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            self._record(body)
            if self.path != "/llm/v1/chat/completions":
                return self._send(404, b'{"detail": "Not Found"}', "application/json")
            if body.get("model") == "missing":
                return self._send(404, json.dumps(UPSTREAM_ERROR).encode(), "application/json")
            if body.get("model") == "hang-up":
                self.close_connection = True  # no answer at all: the connection just closes
                return None
            failing = state.take_failure()
            if not body.get("stream"):
                if failing:
                    return self._send(500, json.dumps(GENERATION_ERROR).encode(), "application/json")
                return self._send(200, json.dumps(COMPLETION).encode(), "application/json")
            sse = (FAILED_AFTER_OUTPUT_SSE if state.fail_after_output else FAILED_SSE) if failing else SSE
            return self._stream(sse.split("\n\n")[:-1])

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
