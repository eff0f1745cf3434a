"""``EPDProxy``'s side of the vLLM server: forwarding a request, relaying the answer, and
telling an answer a retry may fix from one to pass on.

vLLM fails a chat request it accepted (a worker could not load a staged item, say) with a
5xx: a JSON error body, or for ``"stream": true`` a 200 stream with the event ``data:
{"error": {..., "code": 500}}``. When the failure is known before the request runs, that
event follows nothing but a role-only chunk. ``first_events`` reads a stream up to its
first event with output (or an error), so the proxy can still retry while nothing has
reached its client; ``relay`` then sends those events and the rest as they arrive.
"""

# No `from __future__ import annotations`: FastAPI reads the annotations of what it serves.
import dataclasses
import json
from typing import Any, AsyncIterator

import httpx
from fastapi import Request
from fastapi.responses import Response

from registry.errors import Unavailable
from registry.logs import get_logger

logger = get_logger("deployments.proxy")  # the proxy's lines, whichever module writes them

# What a stream may hold back before the proxy commits to relaying it: vLLM's preamble is
# one role-only chunk, so these bound only a server that never sends output.
_MAX_HELD_EVENTS = 16
_MAX_HELD_BYTES = 256 * 1024


@dataclasses.dataclass(slots=True)
class StreamStart:
    """A stream's beginning: ``held`` (the bytes read, sent first when relayed), the rest
    still to read (``chunks``), and ``failure``: the message of a 5xx error event in
    ``held``, which nothing has reached the client of yet."""

    held: bytes
    chunks: AsyncIterator[bytes]
    failure: str | None = None


class Upstream:
    """One HTTP client per proxy replica, for the vLLM server at ``base_url``.

    No connection cap (the replica's ``max_ongoing_requests`` bounds them), and no
    proxies from the environment: the vLLM server is a peer in the cluster.
    """

    def __init__(self, base_url: str, timeout_s: float):
        self.base_url = base_url
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    def request(self, incoming: Request, method: str, path: str, content: bytes | None = None) -> httpx.Request:
        """``method path`` on the vLLM server, with the client's ``accept`` and ``authorization``."""
        headers = {"accept": incoming.headers.get("accept", "*/*")}
        if content is not None:
            headers["content-type"] = "application/json"
        if "authorization" in incoming.headers:
            headers["authorization"] = incoming.headers["authorization"]
        return self._client.build_request(method, f"{self.base_url}{path}", content=content, headers=headers)

    async def send(self, request: httpx.Request) -> httpx.Response:
        """The response, its headers read and its body not."""
        try:
            return await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise Unavailable("the model server is not reachable; retry shortly") from exc

    @staticmethod
    async def buffered(response: httpx.Response) -> Response:
        """The whole answer: its status, body and content type."""
        try:
            content = await response.aread()
        except httpx.HTTPError as exc:
            raise Unavailable("the model server's answer broke off; retry") from exc
        finally:
            await response.aclose()
        return Response(content, status_code=response.status_code, media_type=response.headers.get("content-type"))

    @staticmethod
    async def first_events(response: httpx.Response) -> StreamStart:
        """Read a stream until an event carries output or an error, it ends, or too much is held."""
        chunks = response.aiter_bytes()
        held, pending, events = b"", b"", 0
        try:
            async for chunk in chunks:
                held += chunk
                pending += chunk.replace(b"\r\n", b"\n")
                while b"\n\n" in pending:
                    event, pending = pending.split(b"\n\n", 1)
                    events += 1
                    verdict = _event_verdict(event)
                    if verdict == "preamble" and events < _MAX_HELD_EVENTS and len(held) < _MAX_HELD_BYTES:
                        continue
                    failure = verdict.removeprefix("failure:") if verdict.startswith("failure:") else None
                    return StreamStart(held, chunks, failure)
        except httpx.HTTPError as exc:
            await response.aclose()
            raise Unavailable("the model server's stream broke off; retry") from exc
        return StreamStart(held, chunks)

    @staticmethod
    async def relay(response: httpx.Response, start: StreamStart, req_ids: list[str]) -> AsyncIterator[bytes]:
        """``start.held``, then the rest as it arrives; a broken stream ends with an SSE error event."""
        try:
            if start.held:
                yield start.held
            async for chunk in start.chunks:
                yield chunk
        except httpx.HTTPError as exc:
            logger.error("chat stream (req_ids=%s) broke off upstream: %r", req_ids, exc)
            error = Unavailable("the model server's stream broke off; retry")
            yield f"data: {json.dumps(error.to_dict(mask=True))}\n\n".encode()
        finally:
            await response.aclose()


def _event_verdict(event: bytes) -> str:
    """``preamble`` (no output yet: a role-only chunk, a comment), ``output`` (anything the
    client must see now), or ``failure:<message>`` (an error event with a 5xx code)."""
    data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if not data:
        return "preamble"  # comments and keep-alives
    if data == b"[DONE]":
        return "output"
    try:
        body: Any = json.loads(data)
    except ValueError:
        return "output"
    if not isinstance(body, dict):
        return "output"
    error = body.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        if isinstance(code, int) and code >= 500:
            return f"failure:[{code}] {error.get('message', '')}"
        return "output"
    choices = body.get("choices")
    if not isinstance(choices, list) or body.get("usage"):
        return "output"
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or choice.get("finish_reason") is not None:
            return "output"
        if any(value for key, value in delta.items() if key != "role"):
            return "output"
    return "preamble"
