"""Admission: whether the registry takes a *new* request (retries of live ones are always
answered). A new request is refused with ``overloaded`` (429, ``Retry-After``) while
``max_pending_requests`` requests are being encoded, while the staged bytes reach
``max_staged_bytes``, or while the media the pending requests hold (their inputs, in the
object store until their encode ends) would pass ``max_pending_input_bytes`` with this
request's (a request alone is always admitted: ``max_request_bytes`` bounds it).

Staged bytes are projected: what entries hold now, plus what the pending ones will add at
the mean size of the entries staged so far, so a burst of accepted requests cannot
overshoot the budget by much once they land.
"""

from __future__ import annotations

from registry.errors import Overloaded
from registry.settings import Limits


def check_admission(
    limits: Limits, req_id: str, *, pending: int, staged_bytes: int, mean_staged_bytes: int, pending_input_bytes: int = 0,
    input_bytes: int = 0,
) -> None:
    """Raise ``Overloaded`` if a new request (of ``input_bytes`` of media) would pass a limit."""
    if pending >= limits.max_pending_requests:
        raise Overloaded(
            f"{pending} requests are being encoded (max_pending_requests={limits.max_pending_requests}); retry shortly",
            req_id,
            {"retry_after_s": 1},
        )
    if pending_input_bytes and pending_input_bytes + input_bytes > limits.max_pending_input_bytes:
        raise Overloaded(
            f"the requests being encoded hold {pending_input_bytes} bytes of media ({pending_input_bytes + input_bytes} "
            f"with this one's); the limit is {limits.max_pending_input_bytes} (max_pending_input_bytes); retry shortly",
            req_id,
            {"retry_after_s": 1},
        )
    projected = staged_bytes + pending * mean_staged_bytes
    if projected >= limits.max_staged_bytes:
        raise Overloaded(
            f"staged embeddings hold {staged_bytes} bytes ({projected} with the requests being encoded); "
            f"the limit is {limits.max_staged_bytes} (max_staged_bytes); retry once ranks have fetched",
            req_id,
            {"retry_after_s": 1},
        )
