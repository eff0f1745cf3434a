"""The ``EPDProxy`` deployment: an OpenAI-compatible chat endpoint in front of one vLLM server.

vLLM names each multimodal item by the ``uuid`` a client sets on its chat content
part, and its encoder-cache connector loads the item's embedding staged under that
name. The proxy lets ordinary OpenAI clients use that: per chat request

1. parse the body (``messages[*].content`` parts; 422 ``invalid_request`` if malformed);
2. give every ``image_url`` part a content-derived ``uuid`` (``content_uuid``: the same
   image for the same vLLM instance and TP size gives the same uuid, so vLLM's prefix
   and encoder caches keep working across requests) and submit each distinct one as a
   one-item encode (``wait: false``, ``receive_count`` = the TP size) to the epd app,
   all at once. A uuid the client set is replaced (only ours names something staged);
   for an http(s) URL the uuid is of the URL text, so changed content behind a URL
   whose entry is still live answers ``conflict``. A submit error fails the request
   with that error and nothing is forwarded; ``already_released`` is not an error:
   this vLLM instance already got that content (it uses its own cache or encodes the
   item itself);
3. forward the body, uuids set, to ``{vllm_url}/v1/chat/completions`` at once (vLLM
   holds the request until the items are staged, so encoding overlaps its
   tokenization) and meanwhile wait for each item to leave ``pending``;
4. an item that ends failed, expired or cancelled first closes the upstream request
   and answers that item's error; otherwise the upstream answer is relayed once every
   item is staged or released: its status and JSON body, or (``"stream": true``) its
   server-sent events chunk by chunk as they arrive.

Only ``image_url`` parts are staged. Other parts (text, ``video_url``,
``input_audio``, ...) are forwarded untouched: this service encodes videos given as
frame lists, not video files, so vLLM handles those itself.

Entries this proxy submitted but vLLM never fetches (the upstream failed, or another
item of the request failed) are not cancelled here, as another chat request may
share them (same content, same uuid); the registry expires them after ``ttl_s``.

Python::

    from ray import serve
    from deployments import build_app, build_proxy_app
    serve.run(build_app({}), name="epd", route_prefix="/")
    serve.run(build_proxy_app({"vllm_url": "http://127.0.0.1:8100", "tensor_parallel_size": 2}),
              name="epd-proxy", route_prefix="/proxy")

YAML: a second application with ``import_path: deployments.app:build_proxy_app`` and
the ``ProxyConfig`` keys under ``args``.
"""

# No `from __future__ import annotations`: FastAPI reads the route methods' annotations at runtime.
import asyncio
import dataclasses
import hashlib
import json
import logging
import uuid
from typing import Any, AsyncIterator, Awaitable, Iterable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle

from deployments.config import ProxyConfig
from deployments.http_api import error_response, read_body
from registry.errors import (
    ERRORS_BY_CODE,
    AlreadyReleased,
    Cancelled,
    EncodeFailed,
    Expired,
    InvalidRequest,
    NotReady,
    Overloaded,
    RegistryError,
    Unavailable,
    http_status,
    unwrap,
)
from registry.logs import get_logger, quiet_client_errors

logger = get_logger(__name__)

# Longest single registry wait for an item to leave pending; the proxy waits again
# until its own deadline (timeout_s). Short enough that an Ingress replica restart
# costs little, long enough to be one call per item in practice.
_DESCRIBE_SLICE_S = 30.0
_READY_STATES = ("staged", "released")  # released: a fast vLLM instance already fetched it
_ENDED_ERRORS: dict[str, type[RegistryError]] = {"failed": EncodeFailed, "expired": Expired, "cancelled": Cancelled}

proxy_api = FastAPI(
    title="epd-proxy",
    summary="OpenAI-compatible chat proxy that stages image embeddings for a vLLM server",
    version="0.1.0",
)


@proxy_api.exception_handler(RegistryError)
async def _on_registry_error(_: Request, exc: RegistryError) -> JSONResponse:
    return error_response(exc)


def content_uuid(vllm_url: str, tensor_parallel_size: int, url: str) -> str:
    """The ``uuid`` of an image part: a function of the vLLM instance, its TP size and the
    image URL or data URI, so that the same image always gets the same name there.
    A UUID string, which also matches the encoder's ``req_id`` pattern."""
    key = f"{vllm_url}|{tensor_parallel_size}|{url}".encode()
    return str(uuid.UUID(bytes=hashlib.blake2b(key, digest_size=16).digest()))


@dataclasses.dataclass(frozen=True, slots=True)
class ChatRequest:
    """A parsed chat body with ``uuid`` set on its image parts, and what to encode per uuid."""

    body: dict[str, Any]
    items: dict[str, dict[str, Any]]  # uuid -> our one-item encode item
    where: dict[str, str]  # uuid -> the first part carrying it, for error messages

    @property
    def req_ids(self) -> list[str]:
        return list(self.items)


def parse_chat_request(raw: bytes, vllm_url: str, tensor_parallel_size: int) -> ChatRequest:
    """Parse a chat completions body and name its image parts (sets ``part["uuid"]``).

    Raises:
        InvalidRequest: not JSON, nested too deeply, not an object, ``messages`` not a
            list, a message or content part not an object, an ``image_url`` part
            without a string ``image_url.url``.
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("the request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest('"messages" must be a list of message objects')
    items: dict[str, dict[str, Any]] = {}
    where: dict[str, str] = {}
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object, got {type(message).__name__}")
        content = message.get("content")
        if not isinstance(content, list):  # a string, or absent: nothing to stage
            continue
        for j, part in enumerate(content):
            at = f"messages[{i}].content[{j}]"
            if not isinstance(part, dict):
                raise InvalidRequest(f"{at} must be an object, got {type(part).__name__}")
            if part.get("type") != "image_url":
                continue
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else None
            if not isinstance(url, str) or not url:
                raise InvalidRequest(f'{at}: an "image_url" part needs "image_url": {{"url": "..."}}')
            part_uuid = content_uuid(vllm_url, tensor_parallel_size, url)
            # A client's own uuid is replaced: only ours names something staged.
            part["uuid"] = part_uuid
            if part_uuid not in items:
                items[part_uuid] = {"type": "image_url", "image_url": {"url": url}}
                where[part_uuid] = at
    return ChatRequest(body=body, items=items, where=where)


async def _all_or_first_error(aws: Iterable[Awaitable[Any]]) -> list[Any]:
    """Run ``aws`` concurrently; on the first error cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()


def _located(error: RegistryError, where: str) -> RegistryError:
    """``error`` of a one-item encode, its ``items[0]`` renamed to the chat part it came from."""
    message = error.message.removeprefix("items[0]: ")
    return type(error)(f"{where}: {message}", error.req_id, error.details or None)


def _ended_error(req_id: str, described: dict[str, Any]) -> RegistryError:
    """The error of an entry that ended without being staged (``describe``'s answer)."""
    state = described.get("state")
    error = described.get("error") or {}
    cls = ERRORS_BY_CODE.get(error.get("code"), _ENDED_ERRORS.get(state, EncodeFailed))
    return cls(error.get("message") or f"req_id {req_id} ended {state} before it was staged", req_id)


@serve.deployment(name="EPDProxy", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0.25})
@serve.ingress(proxy_api)
class EPDProxy:
    """OpenAI-compatible ``/v1/chat/completions`` and ``/v1/models`` in front of ``vllm_url``.

    Args:
        config: the ``ProxyConfig`` fields, as a dict.
    """

    def __init__(self, config: dict[str, Any]):
        quiet_client_errors()
        self._config = ProxyConfig.model_validate(config)
        # One client per replica: its connection pool is shared by every request. No
        # connection cap (max_ongoing_requests bounds them), and no proxies from the
        # environment: the vLLM server is a peer in the cluster.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self._config.timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,
        )
        self._encoder: DeploymentHandle | None = None

    async def __del__(self) -> None:
        # Serve calls this on graceful shutdown.
        await self._client.aclose()

    # --- the encoder app ------------------------------------------------------------

    async def _call_encoder(self, method: str, *args: Any) -> Any:
        app = self._config.encoder_app
        try:
            if self._encoder is None:
                # Blocking (a controller call), and the app may be deployed after this one.
                self._encoder = await asyncio.to_thread(serve.get_app_handle, app)
            return await getattr(self._encoder, method).remote(*args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to the project's errors
            cause = unwrap(exc)
            if isinstance(cause, RegistryError):
                raise cause.fresh() from None
            if isinstance(cause, BackPressureError):
                raise Overloaded("the encoder service's queue is full; retry later") from exc
            if isinstance(cause, (RayActorError, RayServeException, ConnectionError, TimeoutError)):
                raise Unavailable("the encoder service is not reachable; retry shortly") from exc
            # A bug (here or in the encoder app), not a reason to retry: 500, cause in the log.
            logger.error("calling the encoder app's %s failed", method, exc_info=exc)
            raise RegistryError("the proxy failed calling the encoder service; the cause is in the proxy's log") from None

    async def _submit(self, chat: ChatRequest, req_id: str) -> str:
        """Submit one item; its state (``released`` for ``already_released``)."""
        body = {
            "req_id": req_id,
            "receive_count": self._config.tensor_parallel_size,
            "items": [chat.items[req_id]],
            "wait": False,
        }
        try:
            out = await self._call_encoder("encode", body)
        except AlreadyReleased:
            logger.info(
                "req_id=%s: already released to this vLLM instance; forwarding (vLLM uses its own cache "
                "or encodes the item itself)", req_id,
            )
            return "released"
        except InvalidRequest as exc:
            raise _located(exc, chat.where[req_id]) from None
        return out["state"]

    async def _wait_ready(self, chat: ChatRequest, req_id: str, deadline: float) -> None:
        """Return once ``req_id`` is staged or released; raise its error if it ended otherwise."""
        loop = asyncio.get_running_loop()
        while (remaining := deadline - loop.time()) > 0:
            described = await self._call_encoder("describe", req_id, min(remaining, _DESCRIBE_SLICE_S))
            state = described["state"]
            if state in _READY_STATES:
                return
            if state != "pending":
                error = _ended_error(req_id, described)
                raise _located(error, chat.where[req_id]) if isinstance(error, InvalidRequest) else error
        raise NotReady(f"req_id {req_id} was not staged within {self._config.timeout_s}s (timeout_s)", req_id)

    # --- upstream -------------------------------------------------------------------

    def _upstream_request(self, request: Request, method: str, path: str, content: bytes | None = None) -> httpx.Request:
        headers = {"accept": request.headers.get("accept", "*/*")}
        if content is not None:
            headers["content-type"] = "application/json"
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        return self._client.build_request(method, f"{self._config.vllm_url}{path}", content=content, headers=headers)

    async def _send(self, upstream: httpx.Request) -> httpx.Response:
        try:
            return await self._client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            raise Unavailable("the model server is not reachable; retry shortly") from exc

    async def _buffered(self, upstream: httpx.Response) -> Response:
        """The whole upstream answer: its status, body and content type."""
        try:
            content = await upstream.aread()
        except httpx.HTTPError as exc:
            raise Unavailable("the model server's answer broke off; retry") from exc
        finally:
            await upstream.aclose()
        return Response(content, status_code=upstream.status_code, media_type=upstream.headers.get("content-type"))

    async def _relay(self, upstream: httpx.Response, req_ids: list[str]) -> AsyncIterator[bytes]:
        """The upstream bytes as they arrive; a broken stream ends with an SSE error event."""
        try:
            async for chunk in upstream.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            logger.error("chat stream (req_ids=%s) broke off upstream: %r", req_ids, exc)
            error = Unavailable("the model server's stream broke off; retry")
            yield f"data: {json.dumps(error.to_dict(mask=True))}\n\n".encode()
        finally:
            await upstream.aclose()

    async def _forward_when_ready(self, chat: ChatRequest, upstream: httpx.Request, waiting: list[str]) -> httpx.Response:
        """Send ``upstream`` and wait for the ``waiting`` items at the same time.

        Returns the upstream response (headers read, body not) once every item is
        staged or released; an item's error, or the upstream's, closes the other side.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.timeout_s
        send = asyncio.ensure_future(self._send(upstream))
        ready = asyncio.ensure_future(_all_or_first_error(self._wait_ready(chat, r, deadline) for r in waiting))
        handed_over = False
        try:
            await asyncio.wait((send, ready), return_when=asyncio.FIRST_EXCEPTION)
            if ready.done() and ready.exception() is not None:  # the item's error wins over the upstream's
                raise ready.exception()
            if send.done() and send.exception() is not None:
                raise send.exception()
            response = send.result()
            handed_over = True
            return response
        finally:
            for task in (send, ready):
                task.cancel()  # an unfinished send: httpx drops the connection, vLLM aborts the request
            if not handed_over and send.done() and not send.cancelled() and send.exception() is None:
                await send.result().aclose()

    # --- HTTP -----------------------------------------------------------------------

    @proxy_api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        """OpenAI chat completions (streaming or not), with image parts staged for vLLM."""
        chat: ChatRequest | None = None
        try:
            raw = await read_body(request, self._config.max_request_bytes)
            cfg = self._config
            # Threads: parsing, hashing data URIs and serializing a large body block.
            chat = await asyncio.to_thread(parse_chat_request, raw, cfg.vllm_url, cfg.tensor_parallel_size)
            states = await _all_or_first_error(self._submit(chat, r) for r in chat.req_ids)
            waiting = [r for r, state in zip(chat.req_ids, states) if state not in _READY_STATES]
            content = await asyncio.to_thread(lambda: json.dumps(chat.body).encode())
            upstream = await self._forward_when_ready(
                chat, self._upstream_request(request, "POST", "/v1/chat/completions", content), waiting
            )
        except RegistryError as exc:
            self._log_failure(exc, chat)
            return error_response(exc)
        if upstream.status_code >= 400:
            logger.info("chat request (req_ids=%s): the model server answered %d", chat.req_ids, upstream.status_code)
        if chat.body.get("stream") is True and upstream.status_code < 400:
            return StreamingResponse(
                self._relay(upstream, chat.req_ids),
                status_code=upstream.status_code,
                media_type=upstream.headers.get("content-type", "text/event-stream"),
            )
        try:
            return await self._buffered(upstream)
        except RegistryError as exc:
            self._log_failure(exc, chat)
            return error_response(exc)

    @proxy_api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        """The model server's ``/v1/models``, relayed."""
        try:
            return await self._buffered(await self._send(self._upstream_request(request, "GET", "/v1/models")))
        except RegistryError as exc:
            self._log_failure(exc, None)
            return error_response(exc)

    @staticmethod
    def _log_failure(exc: RegistryError, chat: ChatRequest | None) -> None:
        status = http_status(exc)
        cause = f" (cause: {exc.__cause__!r})" if exc.__cause__ is not None else ""
        logger.log(
            logging.ERROR if status >= 500 else logging.INFO,
            "request failed: req_id=%s req_ids=%s code=%s status=%d: %s%s",
            exc.req_id, chat.req_ids if chat else [], exc.code, status, exc.message, cause,
        )
