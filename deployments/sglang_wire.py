"""SGLang 0.5.23's encoder-server protocol, as its language-only servers speak it.

What an SGLang server started with ``--language-only --encoder-urls URL`` sends to
``URL`` and expects back (``sglang/srt/disaggregation/encoder/``):

* ``POST /encode`` from its tokenizer, one per *part* (the images of a request one
  encoder handles): ``req_id`` is ``<rid>_local_part_<k>``, with ``mm_items`` (URL
  strings, or dicts with ``"url"``), ``num_parts``, ``part_idx``, ``modality``, and
  ``embedding_port`` (set only for ``zmq_to_tokenizer``: the one copy goes to
  ``prefill_host:embedding_port``). Success is ``200 null``; an error is
  ``{"status": "error", "message", "req_id"}`` with 400 for bad input.
* ``POST /scheduler_receive_url`` from each scheduler TP rank (``zmq_to_scheduler``):
  ``{"req_id": <part id>, "receive_count": <TP size>, "receive_url": "host:port"}``.
* One ZMQ message per part per rank, to a PULL socket the rank binds: frame 0 is a
  pickled ``sglang.srt.disaggregation.encoder.receiver.EmbeddingData`` (no tensor in
  it), frame 1 the raw bytes of the part's ``[tokens, hidden]`` embedding in its
  dtype. An error is frame 0 alone, with ``error_msg`` and ``error_code`` set.

The receiver loads frame 0 with SGLang's ``safe_pickle_loads``, an allowlist of
globals. The header is written here opcode by opcode, naming only globals on that
list (``EmbeddingData``, ``Modality``, ``torch.LongTensor``, a torch dtype), so
the encoder service imports neither SGLang nor torch to write it.
"""

from __future__ import annotations

import ipaddress
import struct
import time
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.schemas import describe_validation_error
from registry.errors import HTTP_STATUS, EncodeFailed, InvalidRequest, RegistryError

# SGLang's ``Modality`` enum values (sglang/srt/multimodal/modality.py).
MODALITIES = {"IMAGE": 1, "VIDEO": 2, "AUDIO": 3}
# The torch dtypes the service stages, by the name its item metadata carries.
_DTYPES = {"float32", "float16", "bfloat16"}
_EMBEDDING_DATA = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
_MODALITY = ("sglang.srt.multimodal.modality", "Modality")
# SGLang's rids are the user's: anything printable (no control characters, which would forge log lines).
_PRINTABLE = r"^[^\x00-\x1f\x7f]+$"


class EncodePart(BaseModel):
    """The body of SGLang's ``POST /encode``. Fields this service does not use are
    accepted and ignored, as SGLang's own server does, so a newer tokenizer that adds
    one still works."""

    model_config = ConfigDict(extra="ignore")

    req_id: str = Field(min_length=1, max_length=512, pattern=_PRINTABLE, description="The part id, <rid>_local_part_<k>.")
    mm_items: list[str | dict[str, Any]] = Field(min_length=1, description="The part's media: URLs, or dicts with url.")
    num_parts: int = Field(ge=1, le=4096, description="How many parts the request was split into.")
    part_idx: int = Field(ge=0, description="This part's index, below num_parts.")
    modality: str = Field("IMAGE", description="IMAGE, VIDEO or AUDIO; this service encodes IMAGE.")
    embedding_port: int | list[int] | None = Field(
        None, description="zmq_to_tokenizer: the tokenizer's PULL port, on prefill_host; else null."
    )
    prefill_host: str | None = Field(None, description="The tokenizer's host, for zmq_to_tokenizer.")


class ReceiveUrl(BaseModel):
    """The body of SGLang's ``POST /scheduler_receive_url``: one TP rank's PULL socket."""

    model_config = ConfigDict(extra="ignore")

    req_id: str = Field(min_length=1, max_length=512, pattern=_PRINTABLE, description="The part id, as in /encode.")
    receive_count: int = Field(description="How many TP ranks receive this part.")
    receive_url: str = Field(min_length=1, max_length=300, description="The rank's PULL socket, host:port.")
    modality: str | None = Field(None, description="The part's modality.")


def parse(model: type[BaseModel], body: Any) -> Any:
    req_id = body.get("req_id") if isinstance(body, dict) and isinstance(body.get("req_id"), str) else None
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc), req_id) from None


def image_items(part: EncodePart) -> list[dict[str, Any]]:
    """The part's media as this service's ``image_url`` items; ``invalid_request`` for what
    it cannot encode."""
    if part.part_idx >= part.num_parts:
        raise InvalidRequest(f"part_idx {part.part_idx} is not below num_parts {part.num_parts}", part.req_id)
    if part.modality != "IMAGE":
        raise InvalidRequest(
            f"modality {part.modality!r} is not supported here: this encoder service takes IMAGE parts "
            "(videos go to POST /v1/encode as frames)",
            part.req_id,
        )
    items = []
    for i, item in enumerate(part.mm_items):
        url = item.get("url") if isinstance(item, dict) else item
        if not isinstance(url, str) or not url:
            raise InvalidRequest(f"mm_items[{i}] must be a URL string or a dict with a url string", part.req_id)
        items.append({"type": "image_url", "image_url": {"url": url}})
    return items


def tcp_endpoint(host_port: str, req_id: str) -> str:
    """``tcp://host:port`` for SGLang's ``host:port`` (an IPv6 host in brackets or bare)."""
    host, sep, port = host_port.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidRequest(f"receive_url must be host:port, got {host_port!r}", req_id)
    host = host.strip("[]")
    try:
        bracketed = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        bracketed = host  # a name: refused by the push policy, which takes IP addresses only
    return f"tcp://{bracketed}:{port}"


def status(code: str) -> int:
    """The status SGLang's clients expect for an error ``code``: 400 where this service's own
    API says 422 (SGLang's encoder answers 400 for every bad request), else the same."""
    found = HTTP_STATUS.get(code, 500)
    return 400 if found == 422 else found


def rank_error(error: RegistryError) -> tuple[str, int]:
    """The text and status ranks are told: a client's mistake as the service saw it, the
    masked message for the service's own failures (their cause is in its logs)."""
    cause = (error.details or {}).get("cause") if isinstance(error, EncodeFailed) else None
    if isinstance(cause, dict) and HTTP_STATUS.get(cause.get("code"), 500) < 500:
        return str(cause.get("message")), status(cause["code"])
    code = status(error.code)
    return (error.public_message() if code >= 500 else error.message), code


# --- the EmbeddingData header, written as pickle protocol 4 ------------------------------


def _text(value: str) -> bytes:
    raw = value.encode()
    return b"\x8c" + bytes([len(raw)]) + raw if len(raw) < 256 else b"X" + struct.pack("<I", len(raw)) + raw


def _global(module: str, name: str) -> bytes:
    return _text(module) + _text(name) + b"\x93"  # STACK_GLOBAL


def _value(value: Any) -> bytes:
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"\x88" if value else b"\x89"
    if isinstance(value, int):
        if -(2**31) <= value < 2**31:
            return b"J" + struct.pack("<i", value)
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw
    if isinstance(value, float):
        return b"G" + struct.pack(">d", value)
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, list):
        return b"](" + b"".join(_value(v) for v in value) + b"e" if value else b"]"
    if isinstance(value, (_Call, _Ref)):
        return value.pickled
    raise TypeError(f"no pickle form for {type(value).__name__}")


class _Call:
    """``module.name(*args)`` in the header: a global called on its arguments (REDUCE)."""

    def __init__(self, module: str, name: str, *args: Any):
        self.pickled = _global(module, name) + b"(" + b"".join(_value(a) for a in args) + b"tR"


class _Ref:
    """A global itself in the header (a torch dtype)."""

    def __init__(self, module: str, name: str):
        self.pickled = _global(module, name)


def header(
    req_id: str,
    num_parts: int,
    part_idx: int,
    modality: str,
    *,
    grid_thw: list[list[int]] | None = None,
    dtype: str | None = None,
    shape: list[int] | None = None,
    error: tuple[str, int] | None = None,
) -> bytes:
    """Frame 0: the pickled ``EmbeddingData`` of one part, as SGLang's ``copy_without_embedding``
    has it (``embedding`` None). ``grid_thw`` per item, t/h/w (``grid_dim``, an int64 tensor
    ``[items, 3]`` once loaded); ``error``: (message, status) for an error message."""
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} has no SGLang form; expected one of {sorted(_DTYPES)}")
    state = {
        "req_id": req_id,
        "num_parts": num_parts,
        "part_idx": part_idx,
        "grid_dim": _Call("torch", "LongTensor", grid_thw) if grid_thw else None,
        "modality": _Call(*_MODALITY, MODALITIES[modality]),
        "embedding": None,
        "send_time": time.time(),
        "dtype": _Ref("torch", dtype) if dtype else None,
        "shape": shape,
        "_mr_ptr": None,
        "error_msg": error[0] if error else None,
        "error_code": error[1] if error else None,
    }
    fields = b"".join(_text(key) + _value(value) for key, value in state.items())
    # PROTO 4; EmbeddingData.__new__(EmbeddingData) (NEWOBJ); its __dict__ (BUILD); STOP.
    return b"\x80\x04" + _global(*_EMBEDDING_DATA) + b")\x81" + b"}(" + fields + b"ub."


def part_frames(part: EncodePart, items: list[tuple[dict[str, Any], np.ndarray]]) -> list[Any]:
    """The message of one part: header and the items' embeddings joined along the tokens
    (one copy only when the part holds several items)."""
    metas = [meta for meta, _ in items]
    dtypes = {meta["dtype"] for meta in metas}
    widths = {int(meta["shape"][-1]) for meta in metas}
    if len(dtypes) != 1 or len(widths) != 1:
        raise InvalidRequest(f"the items of part {part.req_id} differ in dtype or width: {dtypes}, {widths}", part.req_id)
    payloads = [np.ascontiguousarray(payload).reshape(-1) for _, payload in items]
    joined = payloads[0] if len(payloads) == 1 else np.concatenate(payloads)
    tokens = sum(int(np.prod(meta["shape"][:-1])) for meta in metas)
    grids = [list(meta["grid_thw"]) for meta in metas if meta.get("grid_thw") is not None]
    frame0 = header(
        part.req_id, part.num_parts, part.part_idx, part.modality,
        grid_thw=grids if len(grids) == len(metas) else None,
        dtype=dtypes.pop(), shape=[tokens, widths.pop()],
    )
    return [frame0, memoryview(joined).cast("B")]


def error_frames(req_id: str, num_parts: int, part_idx: int, modality: str, error: RegistryError) -> list[Any]:
    """The one-frame message that makes a rank abort the request with ``error``'s text."""
    return [header(req_id, num_parts, part_idx, modality if modality in MODALITIES else "IMAGE", error=rank_error(error))]
