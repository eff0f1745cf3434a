"""HTTP request and response bodies (also what the Python handle takes and returns).

Strict on purpose: ``"receive_count": "2"`` or ``"wait": "yes"`` are refused,
not guessed at, and unknown fields are errors so typos do not pass silently.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar, Union

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from registry.errors import InvalidRequest

_M = TypeVar("_M", bound=BaseModel)
REQ_ID_PATTERN = r"^[A-Za-z0-9._:\-]{1,128}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ImageURL(_Strict):
    url: str = Field(
        description='"data:image/<format>;base64,<bytes>"; or an http(s):// URL on allowed_media_domains; '
        "or a file:// URL or path under allowed_local_media_path."
    )


class ImageURLItem(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class ImageItem(_Strict):
    type: Literal["image"]
    image: str = Field(description="The image file's bytes, base64 encoded.")


class VideoItem(_Strict):
    type: Literal["video"]
    video: list[str] = Field(
        min_length=1, description="The frames, in order; each like an image_url's url. Qwen2-VL/2.5-VL only."
    )


class ImageRefItem(_Strict):
    """Python handle only: the image file's bytes already in the object store, passed on unread
    (``registry.server.inputs.ref_input``), so a caller's ``ray.put`` is the only copy there."""

    type: Literal["image_ref"]
    image_ref: Any = Field(description="A ray.ObjectRef of the image file's bytes (ray.put(data)).")

    @field_validator("image_ref", mode="plain")
    @classmethod
    def _an_object_ref(cls, value: Any) -> Any:
        import ray  # loaded in every process that validates one: a handle caller's is a Ray worker

        if not isinstance(value, ray.ObjectRef):
            raise ValueError(f"must be a ray.ObjectRef of the image bytes, got {type(value).__name__}")
        return value


Item = Annotated[Union[ImageURLItem, ImageItem, VideoItem], Field(discriminator="type")]
HandleItem = Annotated[Union[ImageURLItem, ImageItem, VideoItem, ImageRefItem], Field(discriminator="type")]


class EncodeRequest(_Strict):
    req_id: str | None = Field(
        None, pattern=REQ_ID_PATTERN, description="Your id for the request (generated when absent); 1-128 of [A-Za-z0-9._:-]."
    )
    receive_count: int | None = Field(
        None, ge=1, description="Distinct TP ranks that will fetch it; the app's default_receive_count when absent."
    )
    items: list[Item] = Field(min_length=1, description="Media items, in order.")
    wait: bool = Field(True, description="true: answer once staged (200); false: answer at once (202, pending).")


class HandleEncodeRequest(EncodeRequest):
    """What ``handle.encode.remote(body)`` takes: the HTTP body, and also ``image_ref`` items."""

    items: list[HandleItem] = Field(min_length=1, description="Media items, in order.")


class ItemMeta(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int
    mm_hash: str
    shape: list[int]
    dtype: str
    nbytes: int


class RequestState(BaseModel):
    """What ``/v1/encode`` and ``/v1/requests/{req_id}`` return."""

    model_config = ConfigDict(extra="allow")

    req_id: str
    state: Literal["pending", "staged", "released", "expired", "cancelled", "failed"]
    receive_count: int
    received_ranks: list[int]
    delivering_ranks: list[int] = Field(
        default_factory=list,
        description="Ranks sent the items over HTTP and not counted yet: counted at their acknowledgement, or "
        "http_pull_grace_s after their last pull.",
    )
    items: list[ItemMeta]


class RequestPage(BaseModel):
    """What ``GET /v1/requests`` returns: entries and tombstones in ``req_id`` order."""

    requests: list[RequestState]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class PushRequest(_Strict):
    """``POST /v1/requests/{req_id}/push``: push the items to a ZMQ receiver (``registry.client.zmq_receiver``)."""

    rank: int = Field(description="The receiving TP rank, below the request's receive_count.")
    endpoint: str = Field(description="tcp://<IP>:<port> of the rank's bound PULL socket, inside push_allowed_networks.")
    timeout_s: float = Field(30.0, description="Seconds to wait while the request is pending.")
    wait_for_submit: bool = Field(
        False, description="Also wait (up to timeout_s) for a req_id not submitted yet, instead of 404 unknown_request."
    )


class PushAnswer(BaseModel):
    req_id: str
    rank: int
    delivery: str = Field(description="Names this push in each frame's header; frames of other deliveries are stale.")
    items: int = Field(description="How many items were pushed (one two-frame message each).")


class AcknowledgeRequest(_Strict):
    """``POST /v1/requests/{req_id}/acknowledge``: count ``rank`` as having received the items."""

    rank: int = Field(description="The TP rank that holds the items.")
    transport: Literal["zmq", "http"] = Field("http", description="How the rank got them, for the fetch metrics.")
    timeout_s: float = Field(0.0, description="Seconds to wait while the request is pending.")


class AcknowledgeAnswer(BaseModel):
    req_id: str
    rank: int
    released: bool = Field(description="Whether this rank was the last one and the entry is now released.")


class ErrorBody(BaseModel):
    code: str
    message: str
    req_id: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def parse_encode_request(body: Any, handle: bool = False) -> EncodeRequest:
    """Validate a request body: parsed JSON, or (``handle``) a Python caller's dict."""
    req_id = body.get("req_id") if isinstance(body, dict) else None
    return parse_body(HandleEncodeRequest if handle else EncodeRequest, body, req_id if isinstance(req_id, str) else None)


def parse_body(model: type[_M], body: Any, req_id: str | None = None) -> _M:
    """``body`` (parsed JSON, or a Python caller's dict) as ``model``; else ``invalid_request``."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}", req_id)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc), req_id) from None


def describe_validation_error(exc: ValidationError | RequestValidationError) -> str:
    """The problems, each naming its field (``items.0.type: ...``), on one line."""
    problems = []
    for err in exc.errors()[:10]:
        where = ".".join(str(part) for part in err["loc"]) or "body"
        problems.append(f"{where}: {err['msg']}")
    return "invalid request: " + "; ".join(problems)
