"""The ``Ingress`` deployment: the HTTP API (FastAPI, OpenAPI at ``/docs``) and the Python handle.

``serve.get_app_handle("epd").encode.remote(body)`` and ``POST /v1/encode`` run
the same code: validate, unwrap the media bytes, hash them and store each large
item once in the object store (``registry.server.inputs``), hand the refs to the
registry actor (which calls the encoder and owns the results), answer with the
entry. Requests that need not wait for staging share registry calls
(``deployments.submits``). The handle's ``fetch_media`` fetches one URL item under
the same media policy and answers its bytes and digest, staging nothing (``EPDProxy``
names URL images by their content with it).

Errors: every failure is a ``RegistryError``; HTTP clients get the error body
of ``deployments.http_api``; handle callers get the exception itself. The routes
for decoder ranks outside Ray and the listing are ``deployments.decoder_routes``';
SGLang's encoder protocol, under ``/sglang``, is ``deployments.sglang_routes``'.
"""

# No `from __future__ import annotations` here: FastAPI reads the route methods'
# annotations at runtime, and as strings `request: Request` became a query parameter.
import asyncio
import contextlib
import hashlib
import hmac
import time
import uuid
from typing import Any

import ray
from fastapi import Query, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.config import AppConfig
from deployments.decoder_routes import DecoderRoutes
from deployments.http_api import ERROR_RESPONSES, api, as_registry_error, log_once, logger, read_json
from deployments.schemas import EncodeRequest, ImageURLItem, RequestState, parse_body, parse_encode_request
from deployments.sglang_routes import SglangRoutes
from deployments.submits import SubmitBatcher
from deployments.zmq_push import ZmqPusher
from encoder import MediaError, item_media, media_digest
from encoder.media import media_type
from registry import MediaInput, media_input
from registry.errors import InvalidRequest, Overloaded, RegistryError, Unauthorized, Unavailable
from registry.server.inputs import ref_input
from registry.logs import quiet_client_errors, replica_log_format
from registry.server.create import get_or_create_registry, get_or_create_shards
from registry.settings import MAX_WAIT_S, api_token_from_env
from registry.routing import sum_stats
from registry.supervision import gather_within

_HEALTH_TIMEOUT_S = 5.0

@serve.deployment(name="Ingress", max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.25})
@serve.ingress(api)
class Ingress(DecoderRoutes, SglangRoutes):
    def __init__(self, encoder: DeploymentHandle, config: dict[str, Any]):
        quiet_client_errors()
        self._config = AppConfig.model_validate(config)
        self._media_policy = self._config.media_policy()
        token = self._config.api_token or api_token_from_env()
        self._token = token.encode() if token else None
        self._encoder = encoder
        self._push_networks = self._config.push_networks()
        self._pusher = ZmqPusher()
        self._sglang_parts: set[asyncio.Task] = set()  # SGLang parts being served
        self._waiting_now = 0  # requests waiting in the registry (max_waiting_requests)
        # The registry calls the Encoder this replica was bound to (it must own the results).
        self._settings = self._config.registry_settings(encoder.app_name, encoder.deployment_name)
        self._shards = get_or_create_shards(self._settings)
        self._settings = self._shards.settings  # with the shard count the registry has
        self._submits = SubmitBatcher(self._call_shard, self._config.registry_call_max_requests)
        # Blocking is fine here: the replica serves nothing until its constructor returns.
        ray.get([call for i in range(len(self._shards)) for call in self._configure(i)],
                timeout=self._config.registry_call_timeout_s)

    def _authorize(self, request: Request) -> None:
        """With a token configured, every route but /health needs ``Authorization: Bearer <token>``."""
        if self._token is None:
            return
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not tell how much of a guess was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self._token):
            raise Unauthorized("missing or wrong API token; send the header Authorization: Bearer <token>")

    def _configure(self, shard: int, after_loss: bool = False) -> list[ray.ObjectRef]:
        handle = self._shards.handles[shard]
        return [
            handle.configure.remote(self._settings.for_shard(shard), after_loss),
            handle.configure_logging.remote(*replica_log_format()),
        ]

    @contextlib.contextmanager
    def _waiting(self, wait_s: float, req_id: str):
        """A request that may wait ``wait_s`` seconds holds one of ``max_waiting_requests``
        while it does; past them it is ``overloaded`` at once. Each waiting request holds one
        of the replica's request slots too: without this bound, enough of them took every
        slot and ``/health`` went unanswered."""
        if wait_s <= 0:
            yield
            return
        limit = self._config.max_waiting_requests
        if self._waiting_now >= limit:
            raise Overloaded(f"{self._waiting_now} requests of this Ingress replica are waiting "
                             f"(max_waiting_requests={limit}); retry shortly", req_id, {"retry_after_s": 1})
        self._waiting_now += 1
        try:
            yield
        finally:
            self._waiting_now -= 1

    async def _call(self, req_id: str, method: str, *args: Any, wait_s: float = 0.0) -> Any:
        """``method`` of the registry shard that holds ``req_id``; ``wait_s``: how long the
        call may wait in the registry by its own arguments (its deadline is that and
        ``registry_call_timeout_s`` more: a registry that is alive but stuck never holds a
        request slot for good)."""
        return await self._call_shard(self._shards.index(req_id), method, req_id, *args, req_id=req_id, wait_s=wait_s)

    async def _call_all(self, method: str, *args: Any) -> list[Any]:
        """``method`` of every shard, at once."""
        return await asyncio.gather(*(self._call_shard(i, method, *args) for i in range(len(self._shards))))

    async def _call_shard(self, shard: int, method: str, *args: Any, req_id: str | None = None, wait_s: float = 0.0) -> Any:
        ref = None
        # A wait the registry will refuse (NaN, negative, past MAX_WAIT_S: it checks) waits nothing.
        wait_s = wait_s if isinstance(wait_s, (int, float)) and 0 <= wait_s <= MAX_WAIT_S else 0.0
        deadline_s = wait_s + self._config.registry_call_timeout_s
        try:
            ref = getattr(self._shards.handles[shard], method).remote(*args)
            # asyncio.timeout, not wait_for: wait_for's task would hold a failed call's exception
            # in a cycle with its frame (the request's input pinned until a collection).
            async with asyncio.timeout(deadline_s):
                return await ref
        except asyncio.CancelledError:
            # The client went away (Serve cancels the handler): cancel the registry's side too,
            # so an encode it was waiting for is not staged for nobody. Not recursively: Ray
            # would also cancel the encoder calls the registry made while serving this call,
            # which are the registry's to stop (it shares them among callers).
            if ref is not None:
                ray.cancel(ref, recursive=False)
            raise
        except TimeoutError:
            ray.cancel(ref, recursive=False)
            logger.warning("req_id=%s: registry shard %d did not answer %s within %g s", req_id, shard, method, deadline_s)
            raise Unavailable(f"the registry did not answer within {deadline_s:g} s; retry shortly", req_id) from None
        except ray.exceptions.ActorDiedError:
            # Gone for good (a crash is restarted by Ray, under the same handle): bring up a
            # new shard for the next call; this one is told to retry.
            await self._recreate_shard(shard)
            raise Unavailable("the registry was down and is being recreated; retry shortly", req_id) from None
        except Exception as exc:  # noqa: BLE001 - re-raised as the project's error
            raise as_registry_error(exc, req_id) from None

    async def _recreate_shard(self, shard: int) -> None:
        try:
            settings = self._settings.for_shard(shard)
            self._shards.handles[shard] = await asyncio.to_thread(get_or_create_registry, settings)
            await asyncio.wait_for(asyncio.gather(*self._configure(shard, after_loss=True)), self._config.registry_call_timeout_s)
            logger.warning("registry shard %d was gone and has been created again (its entries were lost)", shard)
        except Exception as exc:  # noqa: BLE001 - the next call tries again
            logger.warning("creating registry shard %d again failed (%s: %s); the next call tries again",
                           shard, type(exc).__name__, exc)

    # --- Python handle ------------------------------------------------------------

    async def encode(self, body: dict[str, Any]) -> dict[str, Any]:
        """Encode and stage ``body`` (the ``POST /v1/encode`` body, whose items may also be
        ``{"type": "image_ref", "image_ref": ray.put(image_bytes)}``); returns the entry."""
        return await self._encode_body(body, handle=True)

    async def _encode_body(self, body: Any, handle: bool) -> dict[str, Any]:
        try:
            return await self._encode(parse_encode_request(body, handle))
        except RegistryError as exc:
            log_once(exc)
            raise

    async def fetch_media(self, item: dict[str, Any], req_id: str | None = None) -> dict[str, Any]:
        """The bytes of one ``image_url`` item, fetched under this app's ``MediaPolicy``: the
        rules an encode of it follows (``allowed_media_domains``, ``allowed_private_networks``,
        redirects, ``fetch_timeout_s``, ``max_item_bytes``, ``allowed_local_media_path``).
        Stages nothing. What a caller that must name an image by its content (``EPDProxy``)
        calls before it submits the bytes as an ``image_ref`` item.

        Returns:
            ``{"digest": <encoder.hashing.media_digest of the bytes>, "media_type":
            <"image/png", ...; "application/octet-stream" when not recognized>, "data": <bytes>}``.

        Raises:
            InvalidRequest: the item is malformed, or the policy refuses it, or it cannot be
                fetched (``items[0]: <why>``); it carries ``req_id``, which names the item
                in the error and in this replica's log.
        """
        try:
            parsed = parse_body(ImageURLItem, item, req_id)
            try:
                # Thread: fetching blocks; the hash and the header read scale with the size.
                data = await asyncio.to_thread(item_media, parsed.model_dump(), self._media_policy)
            except MediaError as exc:
                raise InvalidRequest(f"items[0]: {exc}", req_id) from None
        except RegistryError as exc:
            log_once(exc)
            raise
        digest, kind = await asyncio.to_thread(lambda: (media_digest(data), media_type(data)))
        return {"digest": digest, "media_type": kind, "data": data}

    async def describe(self, req_id: str, wait_s: float = 0.0, wait_for_submit: bool = False) -> dict[str, Any]:
        """The entry of ``req_id`` (the ``GET /v1/requests/{req_id}`` body); with ``wait_s``,
        wait up to that long while it is pending (and, with ``wait_for_submit``, while it is
        not known yet; else a req_id never seen is ``unknown_request`` at once). Ended entries
        carry ``"error"``."""
        with self._waiting(wait_s, req_id):
            return await self._call(req_id, "describe", wait_s, wait_for_submit, wait_s=wait_s)

    async def _encode(self, request: EncodeRequest) -> dict[str, Any]:
        items = [item.model_dump() for item in request.items]
        return await self._stage(request.req_id or uuid.uuid4().hex, items, request.receive_count, request.wait)

    async def _stage(self, req_id: str, items: list[dict[str, Any]], receive_count: int | None, wait: bool) -> dict[str, Any]:
        """Unwrap, hash and store ``items`` (request items as dicts), hand them to the registry."""
        cfg = self._config
        if len(items) > cfg.max_items_per_request:
            raise InvalidRequest(f"{len(items)} items in one request; the limit is {cfg.max_items_per_request}", req_id)

        def prepare(item: dict[str, Any]) -> MediaInput:
            return media_input(item_media(item, self._media_policy, cfg.max_video_frames))

        async def unwrap_item(index: int, item: dict[str, Any]) -> MediaInput:
            try:
                if item["type"] == "image_ref":  # the caller's stored bytes, passed on unread
                    return await ref_input(item["image_ref"], cfg.max_item_bytes, cfg.fetch_timeout_s)
                # Threads: decoding base64, hashing and fetching URLs block, and items of a
                # request go in parallel.
                return await asyncio.to_thread(prepare, item)
            except MediaError as exc:
                raise InvalidRequest(f"items[{index}]: {exc}", req_id) from None

        logger.debug("req_id=%s received: %d items, receive_count=%s", req_id, len(items), receive_count)
        inputs = await asyncio.gather(*(unwrap_item(i, item) for i, item in enumerate(items)))
        digest = hashlib.sha256()
        for item in inputs:  # what a retry must repeat to join this request: every item's content
            digest.update(item.digest.encode())
        media, key = list(inputs), digest.hexdigest()
        if wait:
            return await self._call(req_id, "submit", media, key, receive_count, True, wait_s=self._config.encode_timeout_s)
        return await self._submits.submit(self._shards.index(req_id), (req_id, media, key, receive_count))

    # --- HTTP ---------------------------------------------------------------------

    @api.post(
        "/v1/encode",
        response_model=RequestState,
        responses={202: {"model": RequestState, "description": "Accepted, still pending (wait=false)."}, **ERROR_RESPONSES},
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": EncodeRequest.model_json_schema()}}}},
    )
    async def post_encode(self, request: Request) -> JSONResponse:
        """Encode media items and stage their embeddings for `receive_count` TP ranks."""
        self._authorize(request)
        out = await self._encode_body(await read_json(request, self._config.max_request_bytes), handle=False)
        return JSONResponse(out, status_code=202 if out["state"] == "pending" else 200)

    @api.get("/v1/requests/{req_id}", response_model=RequestState, responses=ERROR_RESPONSES)
    async def get_request(
        self, request: Request, req_id: str, wait_s: float = Query(0.0, ge=0, le=MAX_WAIT_S),
        wait_for_submit: bool = Query(False, description="Wait (up to wait_s) for a req_id not submitted yet, "
                                      "instead of answering 404 unknown_request at once."),
    ) -> dict[str, Any]:
        """The state of a request; with `wait_s`, wait up to that long while it is pending."""
        self._authorize(request)
        return await self.describe(req_id, wait_s, wait_for_submit)

    @api.delete("/v1/requests/{req_id}", response_model=RequestState, responses=ERROR_RESPONSES)
    async def delete_request(self, request: Request, req_id: str) -> dict[str, Any]:
        """Cancel a pending or staged request; its embeddings are dropped."""
        self._authorize(request)
        return await self._call(req_id, "cancel")

    @api.get("/v1/stats")
    async def get_stats(self, request: Request) -> dict[str, int]:
        """Registry counters: pending, staged, staged_bytes, and totals by outcome."""
        self._authorize(request)
        return sum_stats(await self._call_all("stats"))

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 once the model is loaded and the registry answers; else 503."""
        started = time.monotonic()
        calls = {"the registry": asyncio.ensure_future(self._call_all("ping")),
                 "the Encoder": asyncio.ensure_future(self._encoder.ready.remote())}
        try:
            registry, encoder = await gather_within(_HEALTH_TIMEOUT_S, *calls.values())
            # Shard 0's answer, and each shard's process where there are several.
            registry = {**registry[0], "shard_pids": [ping["pid"] for ping in registry]}
        except asyncio.CancelledError:
            # The probe left first (its timeout is shorter): one line, no traceback.
            waiting = " and ".join(name for name, call in calls.items() if call.cancelled()) or "nothing"
            logger.info("/health: not ready: the probe left after %.1f s, waiting for %s", time.monotonic() - started, waiting)
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means not healthy
            if isinstance(exc, TimeoutError):
                waiting = " and ".join(name for name, call in calls.items() if call.cancelled())
                reason = f"waiting for {waiting} (no answer within {_HEALTH_TIMEOUT_S:g} s)"
            else:
                reason = str(as_registry_error(exc)) or type(exc).__name__
            logger.info("/health: not ready: %s", reason)
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok", "encoder": encoder, "registry": registry})
