"""The ``EPDProxy`` deployment: an OpenAI-compatible chat endpoint in front of one vLLM server.

vLLM names each multimodal item by the ``uuid`` a client sets on its chat content
part, and its encoder-cache connector loads the item's embedding staged under that
name. The proxy lets ordinary OpenAI clients use that: per chat request

1. parse the body (``deployments.chat_request``; 422 ``invalid_request`` if malformed) and
   give every ``image_url`` part a ``uuid`` named by the image's content (the same image for
   the same vLLM instance and TP size gives the same uuid, so vLLM's prefix and encoder
   caches keep working; a different image never gets another's uuid, whose cached embedding
   vLLM would use). A uuid the client set is replaced (only ours names something staged). A
   ``data:`` URI is named by its text. Any other URL names where content was, not what it
   is: the proxy fetches it through the epd app's handle (``Ingress.fetch_media``, under the
   app's ``MediaPolicy``: allowed domains and networks, redirects, size and time limits; the
   proxy never downloads on its own), names it by the bytes' digest and rewrites the part
   to a ``data:`` URI of those bytes, so vLLM gets exactly what was encoded and never
   fetches a third version. A URL the policy refuses, or that fails to fetch, is the
   client's ``invalid_request``; nothing is staged;
2. submit each distinct image as a one-item encode (``wait: false``, ``receive_count`` =
   the TP size) to the epd app, all at once; a fetched image as an ``image_ref`` of its
   bytes. ``already_released`` is not an error: this vLLM instance already got that
   content (it uses its own cache or encodes it itself);
3. forward the body, uuids set, to ``{vllm_url}/v1/chat/completions`` at once (vLLM
   holds the request until the items are staged, so encoding overlaps its
   tokenization) and meanwhile wait for each item to leave ``pending``;
4. relay the answer once every item is staged, released or left to vLLM: its status and
   JSON body, or (``"stream": true``) its server-sent events chunk by chunk.

**Degrade, don't fail** (``local_fallback``, on by default). vLLM's connector encodes an
item itself when the service cannot deliver it, so the proxy forwards the chat anyway
when the service fails: a fetch or a submit that answers ``unavailable``, ``overloaded`` or
an error of the service's own, or an item that ends failed (other than for a bad image),
expired, cancelled, or lost with its registry shard. One WARNING line, ``req_id=<uuid>:
<why>; vLLM encodes it itself``, says which and why (``ITEM_ERROR_ACTIONS`` decides per
code). A URL the service could not fetch is forwarded as it came, under a random uuid:
vLLM fetches it itself, and caches nothing under a name a later chat could reuse.
A client's error (``invalid_request``: a bad image or URL; ``payload_too_large``;
``conflict``) fails the chat with its code either way, and closes the upstream request;
with ``local_fallback: false`` every item error does.

**One retry.** vLLM answers 5xx when it fails a request it accepted because of its images
(a worker could not load a staged item, or one it failed to load before is named again).
The proxy then sends the chat once more, its images submitted again under fresh names
(``ChatRequest.rename``: the engine holds a placeholder under the old ones), and logs one
line saying so. A stream is retried only while nothing has reached the client
(``deployments.upstream``); vLLM learns of a load that failed during the request one
step late, after that step's token was streamed, so such a stream is relayed as it is. A
second failure is relayed as vLLM answered it.

Other parts (text, ``video_url``, ``input_audio``, ...) are forwarded untouched: this
service encodes videos given as frame lists, not video files. Entries this proxy
submitted but vLLM never fetches are not cancelled here, as another chat request may
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
import base64
import logging
from typing import Any, Awaitable, Iterable

import httpx
import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle

from deployments.chat_request import ChatRequest, content_uuid, fetched_uuid, parse_chat_request
from deployments.config import ProxyConfig
from deployments.http_api import error_response, read_body
from deployments.upstream import Upstream
from registry.errors import (
    ERRORS_BY_CODE,
    AlreadyReleased,
    Cancelled,
    Conflict,
    EncodeFailed,
    Expired,
    InvalidRank,
    InvalidRequest,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    RegistryError,
    Unauthorized,
    Unavailable,
    UnknownRequest,
    http_status,
    unwrap,
)
from registry.logs import get_logger, quiet_client_errors

__all__ = ["EPDProxy", "ITEM_ERROR_ACTIONS", "content_uuid", "parse_chat_request"]

logger = get_logger(__name__)

# Longest single registry wait for an item to leave pending; the proxy waits again
# until its own deadline (timeout_s). Short enough that an Ingress replica restart
# costs little, long enough to be one call per item in practice.
_DESCRIBE_SLICE_S = 30.0
_READY_STATES = ("staged", "released")  # released: a fast vLLM instance already fetched it
_FALLBACK = "fallback"  # an item left to vLLM's own vision tower
_ENDED_ERRORS: dict[str, type[RegistryError]] = {"failed": EncodeFailed, "expired": Expired, "cancelled": Cancelled}

# What an item's error does to its chat, per code (a closed set: every code has an action).
# fail: the client's input is wrong, vLLM could not do better with it; forward: vLLM has the
# item already; fallback: the service could not deliver it, vLLM encodes it itself
# (with local_fallback; else the chat fails with it).
ITEM_ERROR_ACTIONS: dict[str, str] = {
    InvalidRequest.code: "fail",
    PayloadTooLarge.code: "fail",
    Conflict.code: "fail",
    Unauthorized.code: "fail",
    InvalidRank.code: "fail",
    AlreadyReleased.code: "forward",
    Unavailable.code: "fallback",
    Overloaded.code: "fallback",
    EncodeFailed.code: "fallback",
    RegistryError.code: "fallback",  # internal: a failure of the service's own
    NotReady.code: "fallback",
    Expired.code: "fallback",
    Cancelled.code: "fallback",
    UnknownRequest.code: "fallback",  # the entry was lost: its registry shard restarted
}

proxy_api = FastAPI(
    title="epd-proxy",
    summary="OpenAI-compatible chat proxy that stages image embeddings for a vLLM server",
    version="0.1.0",
)


@proxy_api.exception_handler(RegistryError)
async def _on_registry_error(_: Request, exc: RegistryError) -> JSONResponse:
    return error_response(exc)


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
        self._upstream = Upstream(self._config.vllm_url, self._config.timeout_s)
        self._encoder: DeploymentHandle | None = None

    async def __del__(self) -> None:
        # Serve calls this on graceful shutdown.
        await self._upstream.aclose()

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

    async def _fetch(self, chat: ChatRequest, name: str) -> None:
        """Fetch the URL image provisionally named ``name`` through the encoder app, under its
        media policy, and name it by its bytes (``ChatRequest.name_fetched``); raise what fails
        the chat. Left to vLLM (the part as it came), the name stays random."""
        item = {"type": "image_url", "image_url": {"url": chat.urls[name]}}
        try:
            fetched = await self._call_encoder("fetch_media", item, name)
        except RegistryError as exc:
            self._on_item_error(chat, name, exc, "fetching it failed")
            return
        data, cfg = fetched["data"], self._config
        # A thread: base64 and the object store's copy of a large image block.
        data_uri, ref = await asyncio.to_thread(
            lambda: (f"data:{fetched['media_type']};base64,{base64.b64encode(data).decode()}", ray.put(data))
        )
        part_uuid = fetched_uuid(cfg.vllm_url, cfg.tensor_parallel_size, fetched["digest"])
        chat.name_fetched(name, part_uuid, data_uri, {"type": "image_ref", "image_ref": ref})

    async def _submit(self, chat: ChatRequest, req_id: str) -> str:
        """Submit one item; its state (``released`` for ``already_released``, or ``_FALLBACK``)."""
        body = {
            "req_id": req_id,
            "receive_count": self._config.tensor_parallel_size,
            "items": [chat.items[req_id]],
            "wait": False,
        }
        try:
            out = await self._call_encoder("encode", body)
        except RegistryError as exc:
            return self._on_item_error(chat, req_id, exc, "submitting it failed")
        return out["state"]

    async def _wait_ready(self, chat: ChatRequest, req_id: str, deadline: float) -> None:
        """Return once ``req_id`` is staged or released, or left to vLLM; raise what fails the chat."""
        loop = asyncio.get_running_loop()
        try:
            while (remaining := deadline - loop.time()) > 0:
                described = await self._call_encoder("describe", req_id, min(remaining, _DESCRIBE_SLICE_S))
                state = described["state"]
                if state in _READY_STATES:
                    return
                if state != "pending":
                    raise _ended_error(req_id, described)
            raise NotReady(f"req_id {req_id} was not staged within {self._config.timeout_s}s (timeout_s)", req_id)
        except RegistryError as exc:
            self._on_item_error(chat, req_id, exc, "it was not staged")

    def _on_item_error(self, chat: ChatRequest, req_id: str, error: RegistryError, what: str) -> str:
        """The item's state from now on, after ``error``; raises it if it fails the chat."""
        action = ITEM_ERROR_ACTIONS.get(error.code, "fallback")
        if action == "forward":
            logger.info(
                "req_id=%s: already released to this vLLM instance; forwarding (vLLM uses its own cache "
                "or encodes the item itself)", req_id,
            )
            return "released"
        if action == "fallback" and self._config.local_fallback:
            # Once per item and chat; the cause of a failure of the service's own is in its log.
            logger.warning("req_id=%s: %s ([%s] %s); vLLM encodes it itself", req_id, what, error.code, error.message)
            return _FALLBACK
        raise _located(error, chat.where[req_id]) if isinstance(error, InvalidRequest) else error

    # --- upstream -------------------------------------------------------------------

    async def _forward_when_ready(self, chat: ChatRequest, upstream: httpx.Request, waiting: list[str]) -> httpx.Response:
        """Send ``upstream`` and wait for the ``waiting`` items at the same time.

        Returns the upstream response (headers read, body not) once every item is
        staged, released or left to vLLM; an error that fails the chat, or the
        upstream's, closes the other side.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.timeout_s
        send = asyncio.ensure_future(self._upstream.send(upstream))
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

    async def _attempt(self, request: Request, chat: ChatRequest, *, may_retry: bool) -> Response | None:
        """Stage ``chat``'s images and forward it once: the answer to relay, or None when it
        failed in a way a retry may fix and ``may_retry`` (``chat`` is renamed for it then)."""
        states = await _all_or_first_error(self._submit(chat, r) for r in chat.req_ids)
        waiting = [r for r, state in zip(chat.req_ids, states) if state not in (*_READY_STATES, _FALLBACK)]
        # Threads: serializing a large body blocks.
        content = await asyncio.to_thread(chat.encoded_body)
        upstream = await self._forward_when_ready(
            chat, self._upstream.request(request, "POST", "/v1/chat/completions", content), waiting
        )
        status = upstream.status_code
        if status >= 500 and may_retry:
            answer = await self._upstream.buffered(upstream)
            self._rename_for_retry(chat, f"the model server answered {status} ({bytes(answer.body)[:300]!r})")
            return None
        if status >= 400:
            logger.info("chat request (req_ids=%s): the model server answered %d", chat.req_ids, status)
        if not chat.stream or status >= 400:
            return await self._upstream.buffered(upstream)
        start = await self._upstream.first_events(upstream)
        if start.failure is not None and may_retry:
            await upstream.aclose()
            self._rename_for_retry(chat, f"its stream failed before any output ({start.failure})")
            return None
        return StreamingResponse(
            self._upstream.relay(upstream, start, chat.req_ids),
            status_code=status,
            media_type=upstream.headers.get("content-type", "text/event-stream"),
        )

    @staticmethod
    def _rename_for_retry(chat: ChatRequest, why: str) -> None:
        renamed = chat.rename()
        logger.warning(
            "chat request (req_ids=%s): %s; retrying it once, its images named afresh (req_ids=%s)",
            list(renamed), why, list(renamed.values()),
        )

    # --- HTTP -----------------------------------------------------------------------

    @proxy_api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        """OpenAI chat completions (streaming or not), with image parts staged for vLLM."""
        chat: ChatRequest | None = None
        try:
            raw = await read_body(request, self._config.max_request_bytes)
            cfg = self._config
            # Threads: parsing and hashing data URIs block.
            chat = await asyncio.to_thread(parse_chat_request, raw, cfg.vllm_url, cfg.tensor_parallel_size)
            await _all_or_first_error(self._fetch(chat, name) for name in list(chat.urls))
            answer = await self._attempt(request, chat, may_retry=True)
            if answer is None:
                answer = await self._attempt(request, chat, may_retry=False)
            return answer
        except RegistryError as exc:
            self._log_failure(exc, chat)
            return error_response(exc)

    @proxy_api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        """The model server's ``/v1/models``, relayed."""
        try:
            return await self._upstream.buffered(await self._upstream.send(self._upstream.request(request, "GET", "/v1/models")))
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
