"""The one exception hierarchy of the service, with stable codes and HTTP statuses.

Every error a client can see is a ``RegistryError`` subclass whose ``code`` is a
stable string (clients branch on it) and whose HTTP status comes from
``HTTP_STATUS``, the only code -> status table in the project.

The exceptions cross process boundaries (registry actor -> ingress -> decoder
rank), so each keeps every constructor argument in ``self.args``: that is what
``pickle`` replays to rebuild it.
"""

from __future__ import annotations

from typing import Any


class RegistryError(Exception):
    """Base class. ``code``: stable error code; ``req_id``: the request, when known;
    ``details``: structured extras (JSON-serializable) for clients."""

    code = "internal"

    def __init__(self, message: str, req_id: str | None = None, details: dict[str, Any] | None = None):
        super().__init__(message, req_id, details)
        self.message = message
        self.req_id = req_id
        self.details = details or {}

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        # Rebuild from args alone; attributes set in __init__ follow from them.
        return (self.__class__, self.args)

    def to_dict(self, *, mask: bool = False) -> dict[str, Any]:
        """The ``{"error": {...}}`` body; ``mask`` hides the message of 5xx errors."""
        body: dict[str, Any] = {"code": self.code, "message": self.public_message() if mask else self.message}
        if self.req_id is not None:
            body["req_id"] = self.req_id
        if self.details and not mask:
            body["details"] = self.details
        return {"error": body}

    def public_message(self) -> str:
        return self.message

    def fresh(self, **changes: Any) -> "RegistryError":
        """A new instance with the same arguments (or those of ``message``, ``req_id``,
        ``details`` given in ``changes``) and no traceback or context.

        Store or re-raise this, never an exception that was raised: its traceback
        pins the frames it passed through, with their locals (ObjectRefs, request
        bytes), for as long as the exception is kept.
        """
        return type(self)(**dict(zip(("message", "req_id", "details"), self.args), **changes))


class InvalidRequest(RegistryError):
    code = "invalid_request"


class Unauthorized(RegistryError):
    code = "unauthorized"


class InvalidRank(RegistryError):
    code = "invalid_rank"


class PayloadTooLarge(RegistryError):
    code = "payload_too_large"


class UnknownRequest(RegistryError):
    code = "unknown_request"


class Conflict(RegistryError):
    code = "conflict"


class AlreadyReleased(RegistryError):
    code = "already_released"


class Expired(RegistryError):
    code = "expired"


class Cancelled(RegistryError):
    code = "cancelled"


class NotReady(RegistryError):
    code = "not_ready"


class Overloaded(RegistryError):
    code = "overloaded"


class Unavailable(RegistryError):
    code = "unavailable"


class EncodeFailed(RegistryError):
    """The model or the serving path failed; the message may hold internals, so
    HTTP clients get a generic message (the registry and logs keep the cause)."""

    code = "encode_failed"

    def public_message(self) -> str:
        suffix = f" for req_id={self.req_id}" if self.req_id else ""
        return f"encoding failed{suffix}; the cause is in the encoder service's logs"


HTTP_STATUS: dict[str, int] = {
    InvalidRequest.code: 422,
    InvalidRank.code: 422,
    Unauthorized.code: 401,
    PayloadTooLarge.code: 413,
    UnknownRequest.code: 404,
    Conflict.code: 409,
    AlreadyReleased.code: 410,
    Expired.code: 410,
    Cancelled.code: 410,
    NotReady.code: 504,
    Overloaded.code: 429,
    Unavailable.code: 503,
    EncodeFailed.code: 500,
}

ERRORS_BY_CODE: dict[str, type[RegistryError]] = {
    cls.code: cls for cls in RegistryError.__subclasses__()
}


def http_status(error: RegistryError) -> int:
    return HTTP_STATUS.get(error.code, 500)


def staged_lost(req_id: str | None) -> Unavailable:
    """Reading a request's staged embeddings found them gone (their node died, or their
    owner, the registry, restarted): the one text every path that finds it says."""
    return Unavailable(
        f"the staged embeddings of req_id {req_id} were lost: the node holding them died or the registry "
        "restarted; encode the request again",
        req_id,
    )


def input_lost(req_id: str | None) -> Unavailable:
    """The encoder found a request's input bytes gone (the process that stored them died)."""
    return Unavailable(
        "the input bytes were lost before the encoder read them (the process that stored them died); "
        "retry the request",
        req_id,
    )


def unwrap(exc: BaseException) -> BaseException:
    """The ``RegistryError`` inside a Ray task error, or ``exc`` itself.

    Ray re-raises an actor's exception as a ``RayTaskError`` that also subclasses
    the original class; handing back the original class keeps ``type(e)`` what the
    user expects. It is a fresh copy: the Ray error holds its ``cause``, so raising
    the cause itself in an ``except`` block that names the Ray error makes a cycle
    (cause -> traceback -> frame -> Ray error -> cause) that pins the frame's locals,
    such as a refused request's input ObjectRefs, until the garbage collector runs.
    """
    cause = getattr(exc, "cause", None)
    if isinstance(cause, RegistryError):
        return cause.fresh()
    return exc
