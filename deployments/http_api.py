"""The HTTP surface shared by the Ingress's routes: the FastAPI app, its error bodies
and the helpers every route uses to read a body and turn failures into errors.

Every failure is a ``RegistryError``; HTTP clients get ``{"error": {"code",
"message", "req_id"?}}`` with the status from ``registry.errors.HTTP_STATUS``
(5xx messages masked).
"""

# No `from __future__ import annotations` here: FastAPI reads handler annotations at runtime.
import asyncio
import json
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from deployments.schemas import ErrorResponse, describe_validation_error
from registry.errors import HTTP_STATUS, InvalidRequest, PayloadTooLarge, RegistryError, Unavailable, http_status, unwrap
from registry.logs import get_logger, log_error

logger = get_logger("deployments.ingress")  # the Ingress's lines, whichever module writes them

_RETRY_AFTER_S = "1"
# Bodies larger than this are parsed off the event loop (read_json).
PARSE_OFF_LOOP_BYTES = 1024 * 1024

api = FastAPI(
    title="epd-encoder",
    summary="Encoder service for disaggregated multimodal LLM serving on Ray",
    version="0.1.0",
)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in sorted(set(HTTP_STATUS.values()))
}


def error_response(error: RegistryError) -> JSONResponse:
    status = http_status(error)
    headers = {"Retry-After": _RETRY_AFTER_S} if status in (429, 503) else None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error.to_dict(mask=status >= 500), status_code=status, headers=headers)


def log_once(error: RegistryError) -> None:
    """Log what this replica refused or failed itself, once; the registry logged what it raised."""
    if not getattr(error, "logged", False):
        log_error(logger, error)
        error.logged = True


@api.exception_handler(RegistryError)
async def _on_registry_error(_: Request, exc: RegistryError) -> JSONResponse:
    log_once(exc)
    return error_response(exc)


@api.exception_handler(RequestValidationError)
async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    error = InvalidRequest(describe_validation_error(exc))
    log_once(error)
    return error_response(error)


def as_registry_error(exc: BaseException, req_id: str | None = None) -> BaseException:
    exc = unwrap(exc)
    if isinstance(exc, RegistryError):
        exc.logged = True  # the registry logs every error it raises
    elif isinstance(exc, ray.exceptions.RayActorError):
        return Unavailable(f"the registry actor is not reachable ({type(exc).__name__}); retry shortly", req_id)
    return exc


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes before buffering them."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the request body is {declared} bytes; the limit is {limit} (max_request_bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes (max_request_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int) -> Any:
    """The request body parsed as JSON, at most ``limit`` bytes; else ``invalid_request``.
    A body over ``PARSE_OFF_LOOP_BYTES`` is parsed on a worker thread: tens of MB take a tenth
    of a second, which on the event loop would hold up every request of the replica."""
    raw = await read_body(request, limit)
    if len(raw) > PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_json, raw)
    return parse_json(raw)


def parse_json(raw: bytes) -> Any:
    """``raw`` parsed as JSON; else ``invalid_request`` saying why."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # the parser's own limit: a body nested thousands deep
        raise InvalidRequest("the request body is nested too deeply to parse") from None
