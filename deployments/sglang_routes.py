"""The Ingress's routes for SGLang language-only servers, under ``/sglang``.

An SGLang 0.5.23 server started with ``--language-only --encoder-urls
http://HOST:8000/sglang`` uses the service as its encoder (the protocol is in
``deployments.sglang_wire``). Each part is one registry entry under SGLang's part id,
with SGLang's ranks counted by the registry's rules:

* ``POST /sglang/encode`` stages the part with ``receive_count`` open (the ranks say
  how many they are), waits until it is staged and every rank registered (one
  registry call), pushes the part to each rank's PULL socket, and counts each rank
  once its push was handed to ZMQ: the last one releases the entry. Then it answers
  ``200 null``, as SGLang's own encoder does.
  With ``embedding_port`` (``zmq_to_tokenizer``) the part has one receiver, the
  tokenizer. The work runs on if the HTTP client leaves, so ranks are never left
  half-served.
* ``POST /sglang/scheduler_receive_url`` claims the next rank number for the
  calling rank's endpoint (a repeat gets the same one) and answers at once; before
  the part's ``/encode`` arrived it waits for it. A rank registering after the entry
  was released or ended is refused at once; after a failed encode it is sent the
  error message, so every rank aborts with the service's error text.
* ``GET /sglang/health``: 200 when ``/health`` is, else 503, with no body.

A request refused before the registry accepted it (a corrupt image) is recorded
with the registry (``refuse``), so ranks waiting for it are told, not left to time out.
"""

# No `from __future__ import annotations` here: FastAPI reads the route methods' annotations at runtime.
import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deployments import sglang_wire as wire
from deployments.http_api import api, log_once, logger, read_json
from deployments.zmq_push import check_endpoint
from registry.errors import EncodeFailed, RegistryError, Unavailable
from registry.settings import MAX_WAIT_S
from registry.server.state import OPEN

# Registration bodies are a few fields.
_SMALL_BODY_BYTES = 64 * 1024
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": 'SGLang\'s error body: {"status": "error", "message", "req_id"}; also 401, 410, 429, 5xx.'}
}


def _error(exc: RegistryError, req_id: str | None) -> JSONResponse:
    """SGLang's error body, with what the ranks are told (a 5xx message masked)."""
    log_once(exc)
    message, code = wire.rank_error(exc)
    return JSONResponse({"status": "error", "message": message, "req_id": req_id}, status_code=code)


def _part_of(req_id: str) -> int:
    """The part index in SGLang's part id ``<rid>_local_part_<k>``, for an error message to a
    rank (which checks only the rid of one)."""
    _, sep, index = req_id.rpartition("_local_part_")
    return int(index) if sep and index.isdigit() else 0


class SglangRoutes:
    """Routes of ``deployments.ingress.Ingress``, which provides ``_authorize``, ``_call``,
    ``_stage``, ``_read_items``, ``health``, ``_config``, ``_push_networks``, ``_pusher`` and
    ``_sglang_parts`` (the parts being served)."""

    @property
    def _sglang_wait_s(self) -> float:
        # As long as a part may wait for its ranks: its staged life.
        return min(self._config.ttl_s, MAX_WAIT_S)

    @api.post("/sglang/encode", tags=["sglang"], responses=_ERRORS)
    async def sglang_encode(self, request: Request) -> Response:
        """SGLang's ``POST /encode``: stage one part and deliver it to its ranks."""
        body: Any = None
        try:
            self._authorize(request)
            body = await read_json(request, self._config.max_request_bytes)
            part = wire.parse(wire.EncodePart, body)
        except RegistryError as exc:
            return _error(exc, body.get("req_id") if isinstance(body, dict) else None)
        task = asyncio.create_task(self._serve_part(part))
        self._sglang_parts.add(task)  # the event loop holds tasks only weakly
        task.add_done_callback(self._part_done)
        try:
            await asyncio.shield(task)  # a client that leaves does not stop the pushes
        except RegistryError as exc:
            return _error(exc, part.req_id)
        except Exception:  # noqa: BLE001 - logged with its traceback by _part_done
            return _error(Unavailable("the encoder service failed serving this part; retry", part.req_id), part.req_id)
        return JSONResponse(None)

    def _part_done(self, task: asyncio.Task) -> None:
        self._sglang_parts.discard(task)
        if not task.cancelled() and not isinstance(task.exception(), (RegistryError, type(None))):
            logger.error("serving an SGLang part failed", exc_info=task.exception())

    @api.post("/sglang/scheduler_receive_url", tags=["sglang"], responses=_ERRORS)
    async def sglang_receive_url(self, request: Request) -> Response:
        """SGLang's ``POST /scheduler_receive_url``: one TP rank's PULL socket for one part."""
        body: Any = None
        try:
            self._authorize(request)
            body = wire.parse(wire.ReceiveUrl, await read_json(request, _SMALL_BODY_BYTES))
            endpoint = check_endpoint(wire.tcp_endpoint(body.receive_url, body.req_id), self._push_networks, body.req_id)
        except RegistryError as exc:
            return _error(exc, getattr(body, "req_id", None))
        try:
            claim = await self._call(body.req_id, "claim", endpoint, body.receive_count, self._sglang_wait_s,
                                     wait_s=self._sglang_wait_s)
        except EncodeFailed as exc:
            # Failed before this rank registered: the rank learns why from its socket, as the
            # ranks that registered in time did.
            frames = wire.error_frames(body.req_id, _part_of(body.req_id) + 1, _part_of(body.req_id), body.modality or "IMAGE", exc)
            await asyncio.gather(self._pusher.push(endpoint, [frames], body.req_id), return_exceptions=True)
            return JSONResponse(None)
        except RegistryError as exc:
            return _error(exc, body.req_id)
        logger.debug("req_id=%s rank %d of %d registered at %s", body.req_id, claim["rank"], claim["receive_count"], endpoint)
        return JSONResponse(None)

    @api.get("/sglang/health", tags=["sglang"])
    @api.get("/sglang/health_generate", tags=["sglang"], include_in_schema=False)
    async def sglang_health(self) -> Response:
        """200 when the service is healthy, else 503 (SGLang's probe reads the status only)."""
        return Response(status_code=(await self.health()).status_code)

    async def _serve_part(self, part: wire.EncodePart) -> None:
        req_id = part.req_id
        try:
            tokenizer = self._tokenizer_endpoint(part)
            await self._stage(req_id, wire.image_items(part), 1 if tokenizer else OPEN, False)
            if tokenizer is not None:
                await self._call(req_id, "claim", tokenizer, 1, 0.0)
            # One call: the registry answers once the part is staged and every rank registered.
            ready = await self._call(req_id, "endpoints", self._sglang_wait_s, wait_s=self._sglang_wait_s)
            if ready["error"] is not None:  # failed, expired or cancelled before delivery
                raise ready["error"]
            await self._deliver(part, ready["endpoints"], ready["items"])
        except RegistryError as exc:
            await self._on_failed_part(part, exc)
            raise

    def _tokenizer_endpoint(self, part: wire.EncodePart) -> str | None:
        """``zmq_to_tokenizer``'s one receiver, checked against the push policy; else None."""
        port = part.embedding_port[0] if isinstance(part.embedding_port, list) and part.embedding_port else part.embedding_port
        if port is None or port == []:
            return None
        endpoint = wire.tcp_endpoint(f"{part.prefill_host}:{port}", part.req_id)
        return check_endpoint(endpoint, self._push_networks, part.req_id)

    async def _deliver(self, part: wire.EncodePart, ranks: dict[str, int], pairs: list[tuple[dict[str, Any], Any]]) -> None:
        """Push the staged part to every rank's endpoint; count each rank whose push ZMQ took."""
        req_id = part.req_id
        message = wire.part_frames(part, await self._read_items(req_id, pairs))

        async def push_and_count(endpoint: str, rank: int) -> None:
            await self._pusher.push(endpoint, [message], req_id)
            await self._call(req_id, "acknowledge", rank, 0.0, "zmq")

        results = await asyncio.gather(*(push_and_count(e, r) for e, r in ranks.items()), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0] if isinstance(failed[0], RegistryError) else Unavailable(
                f"pushing req_id {req_id} to its ranks failed: {failed[0]}", req_id
            )
        logger.debug("req_id=%s pushed to %d ranks", req_id, len(ranks))

    async def _on_failed_part(self, part: wire.EncodePart, error: RegistryError) -> None:
        """Record a refusal the registry did not see, and tell the ranks already registered."""
        req_id = part.req_id
        try:
            await self._call(req_id, "refuse", error.fresh())
            ranks = await self._call(req_id, "endpoints", 0.0)
        except RegistryError:
            return  # the registry is not there: the ranks time out, as they would anyway
        if ranks["error"] is not None:  # ended: no rank will get the part (a failed push leaves it staged)
            await self._tell_ranks(part, ranks["endpoints"], error)
        # A request the registry refused before accepting it is recorded above; its ranks
        # registered so far were told here, later ones are told when they register.

    async def _tell_ranks(self, part: wire.EncodePart, endpoints: dict[str, int], error: RegistryError) -> None:
        frames = wire.error_frames(part.req_id, part.num_parts, part.part_idx, part.modality, error)
        await asyncio.gather(*(self._pusher.push(e, [frames], part.req_id) for e in endpoints), return_exceptions=True)
