"""The Ingress's routes for decoder ranks outside Ray, and the operators' listing.

* ``GET /v1/requests/{req_id}/items?rank=N`` (HTTP pull): waits while pending and
  answers the items as one safetensors file. Rank N is counted when it acknowledges
  (``POST .../acknowledge``) or ``http_pull_grace_s`` after its last pull, never before:
  a response that did not reach it (a dropped connection, a read that timed out, an
  object that could not be read) leaves it uncounted, and its pull again gets the items.
* ``POST /v1/requests/{req_id}/push`` then ``POST .../acknowledge`` (ZMQ push):
  the items go to the rank's bound PULL socket (``deployments.zmq_push``); the
  rank counts only once its receiver acknowledges receipt, so a push that is lost
  never counts and a retried registration or a repeated acknowledgement counts
  once. ``acknowledge`` also serves a rank that already holds the items.
* ``GET /v1/requests?state=&limit=&cursor=``: live entries and tombstones of every
  shard, page by page in ``req_id`` order.

All of them follow the registry's rules and errors, as a Ray rank's calls do.
"""

# No `from __future__ import annotations` here: FastAPI reads the route methods' annotations at runtime.
import asyncio
import base64
import binascii
import heapq
import itertools
import uuid
from typing import Any, Literal

import numpy as np
import ray
from fastapi import Query, Request
from fastapi.responses import Response

from deployments.http_api import ERROR_RESPONSES, api, logger, read_json
from deployments.schemas import AcknowledgeAnswer, AcknowledgeRequest, PushAnswer, PushRequest, RequestPage, parse_body
from deployments.tensor_file import safetensors_bytes
from deployments.zmq_push import check_endpoint, frames
from registry.errors import InvalidRequest, Unavailable, staged_lost
from registry.settings import MAX_WAIT_S
from registry.client.receiver import read_pairs
from registry.states import LIVE_STATES, MAX_LIST_LIMIT, TERMINAL_STATES

# Push and acknowledge bodies are a few fields.
_SMALL_BODY_BYTES = 64 * 1024
# How long reading staged objects may take here before the call fails.
_READ_TIMEOUT_S = 60.0
_STATES = Literal[(*LIVE_STATES, *TERMINAL_STATES)]  # the registry's states, as FastAPI checks a query value
_SAFETENSORS = {200: {"content": {"application/octet-stream": {}}, "description": "The items as one safetensors file."}}


def _cursor(req_id: str) -> str:
    return base64.urlsafe_b64encode(req_id.encode()).decode().rstrip("=")


def _after(cursor: str | None) -> str | None:
    if cursor is None:
        return None
    try:
        after = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        after = ""
    if not after:
        raise InvalidRequest(f"cursor {cursor[:64]!r} is not one this service gave; pass next_cursor as it came")
    return after


class DecoderRoutes:
    """Routes of ``deployments.ingress.Ingress``, which provides ``_authorize``, ``_call``,
    ``_call_all``, ``_waiting``, ``_push_networks`` and ``_pusher``."""

    @api.get("/v1/requests", response_model=RequestPage, responses=ERROR_RESPONSES)
    async def get_requests(
        self,
        request: Request,
        state: _STATES | None = Query(None, description="Only entries in this state."),
        limit: int = Query(100, ge=1, le=MAX_LIST_LIMIT, description="Most entries on this page."),
        cursor: str | None = Query(None, max_length=256, description="The previous page's next_cursor."),
    ) -> dict[str, Any]:
        """Live entries and tombstones, page by page in req_id order."""
        self._authorize(request)
        pages = await self._call_all("list_requests", state, _after(cursor), limit)
        merged = heapq.merge(*(page["requests"] for page in pages), key=lambda entry: entry["req_id"])
        rows = list(itertools.islice(merged, limit))
        more = any(page["more"] for page in pages) or sum(len(page["requests"]) for page in pages) > limit
        return {"requests": rows, "next_cursor": _cursor(rows[-1]["req_id"]) if more and rows else None}

    @api.get("/v1/requests/{req_id}/items", response_class=Response, responses={**_SAFETENSORS, **ERROR_RESPONSES})
    async def get_items(
        self,
        request: Request,
        req_id: str,
        rank: int = Query(description="This TP rank, below the request's receive_count."),
        timeout_s: float = Query(30.0, ge=0, le=MAX_WAIT_S, description="Seconds to wait while pending."),
        wait_for_submit: bool = Query(False, description="Also wait (up to timeout_s) for a req_id not submitted "
                                      "yet, instead of answering 404 unknown_request at once."),
    ) -> Response:
        """Fetch the items as rank `rank`: one safetensors file, tensors `item_0`, `item_1`, ...
        with their metadata in the header's `__metadata__`. The rank is counted when it
        acknowledges them (`POST .../acknowledge`) or `http_pull_grace_s` after its last
        pull; until then a pull again (after a failed one) gets them again."""
        self._authorize(request)
        with self._waiting(timeout_s, req_id):
            pairs = await self._call(req_id, "fetch", rank, timeout_s, "http", wait_for_submit, wait_s=timeout_s)
        items = await self._read_items(req_id, pairs)
        body = await asyncio.to_thread(safetensors_bytes, req_id, items)  # a copy of every byte: off the loop
        return Response(
            body, media_type="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="{req_id}.safetensors"'},
        )

    @api.post("/v1/requests/{req_id}/push", response_model=PushAnswer, responses=ERROR_RESPONSES)
    async def post_push(self, request: Request, req_id: str) -> dict[str, Any]:
        """Push the items to a ZMQ receiver's endpoint; the rank counts once it acknowledges."""
        self._authorize(request)
        body = parse_body(PushRequest, await read_json(request, _SMALL_BODY_BYTES), req_id)
        endpoint = check_endpoint(body.endpoint, self._push_networks, req_id)
        with self._waiting(body.timeout_s, req_id):
            pairs = await self._call(req_id, "peek", body.rank, body.timeout_s, body.wait_for_submit, wait_s=body.timeout_s)
        items = await self._read_items(req_id, pairs)
        delivery = uuid.uuid4().hex
        await self._pusher.push(endpoint, frames(req_id, delivery, items), req_id)
        logger.debug("req_id=%s pushed %d items to rank %d at %s (delivery %s)", req_id, len(items), body.rank, endpoint, delivery)
        return {"req_id": req_id, "rank": body.rank, "delivery": delivery, "items": len(items)}

    @api.post("/v1/requests/{req_id}/acknowledge", response_model=AcknowledgeAnswer, responses=ERROR_RESPONSES)
    async def post_acknowledge(self, request: Request, req_id: str) -> dict[str, Any]:
        """Count `rank` as a receiver: after a push arrived or a pull was read, or for a rank that holds the items already."""
        self._authorize(request)
        body = parse_body(AcknowledgeRequest, await read_json(request, _SMALL_BODY_BYTES), req_id)
        with self._waiting(body.timeout_s, req_id):
            return await self._call(req_id, "acknowledge", body.rank, body.timeout_s, body.transport, wait_s=body.timeout_s)

    async def _read_items(self, req_id: str, pairs: list[tuple[dict[str, Any], Any]]) -> list[tuple[dict[str, Any], np.ndarray]]:
        """(meta, payload) per item of a fetch's answer: small items came in it, large ones are read here."""
        try:
            read = await read_pairs(pairs, _READ_TIMEOUT_S)
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError):
            # Gone with their node: the registry checks and ends the entry, so other ranks are told at once.
            await asyncio.gather(self._call(req_id, "report_lost"), return_exceptions=True)
            raise staged_lost(req_id) from None
        except TimeoutError:
            raise Unavailable(f"reading the staged embeddings of req_id {req_id} timed out; retry", req_id) from None
        return [(meta, item.payload) for meta, item in read]
