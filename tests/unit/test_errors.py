"""The error hierarchy: stable codes, one status table, pickling across processes."""

import gc
import pickle
import weakref

import pytest

from registry import errors

CONTRACT = {
    "invalid_request": 422, "invalid_rank": 422, "unauthorized": 401, "payload_too_large": 413, "unknown_request": 404,
    "conflict": 409, "already_released": 410, "expired": 410, "cancelled": 410, "not_ready": 504,
    "overloaded": 429, "unavailable": 503, "encode_failed": 500,
}


def test_status_table_is_the_contract():
    assert errors.HTTP_STATUS == CONTRACT
    assert set(errors.ERRORS_BY_CODE) == set(CONTRACT)


@pytest.mark.parametrize("code", sorted(CONTRACT))
def test_every_error_pickles_with_its_fields(code):
    cls = errors.ERRORS_BY_CODE[code]
    original = cls("what to fix", "req-1", {"received_ranks": [0, 1]})
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is cls and isinstance(copy, errors.RegistryError)
    assert (copy.code, copy.message, copy.req_id, copy.details) == (code, "what to fix", "req-1", {"received_ranks": [0, 1]})
    assert errors.http_status(copy) == CONTRACT[code]


def test_error_body_and_masking():
    err = errors.EncodeFailed("CUDA OOM in layer 3", "r1", {"cause": "x"})
    assert err.to_dict() == {"error": {"code": "encode_failed", "message": "CUDA OOM in layer 3", "req_id": "r1", "details": {"cause": "x"}}}
    masked = err.to_dict(mask=True)["error"]
    assert "CUDA" not in masked["message"] and "r1" in masked["message"] and "details" not in masked
    assert errors.NotReady("wait longer").to_dict() == {"error": {"code": "not_ready", "message": "wait longer"}}


class _RayStyleWrapper(Exception):
    """What Ray raises for an actor's exception: it holds the original as ``cause``."""

    def __init__(self, cause):
        self.cause = cause


def test_unwrap_returns_a_copy_of_the_cause_of_a_ray_style_wrapper():
    cause = errors.Expired("gone", "r", {"ranks": [0]})
    got = errors.unwrap(_RayStyleWrapper(cause))
    assert type(got) is errors.Expired and got is not cause
    assert (got.message, got.req_id, got.details) == ("gone", "r", {"ranks": [0]})
    plain = ValueError("x")
    assert errors.unwrap(plain) is plain


def test_raising_the_unwrapped_error_frees_the_frame_s_locals_without_the_collector():
    class Inputs:  # stands for a refused request's input ObjectRefs
        pass

    def refuse(inputs):
        try:
            raise _RayStyleWrapper(errors.Overloaded("full"))
        except _RayStyleWrapper as exc:
            raise errors.unwrap(exc) from None

    inputs = Inputs()
    alive = weakref.ref(inputs)
    gc.disable()  # only reference counting frees: a cycle would keep the frame, and inputs, alive
    try:
        try:
            refuse(inputs)
        except errors.Overloaded:
            pass
        else:
            pytest.fail("refuse() raised nothing")
        del inputs
        assert alive() is None
    finally:
        gc.enable()


def test_http_error_response_headers():
    from deployments.http_api import error_response

    overloaded = error_response(errors.Overloaded("queue full", "r"))
    assert overloaded.status_code == 429 and overloaded.headers["Retry-After"] == "1"
    assert error_response(errors.Unavailable("down")).headers["Retry-After"] == "1"
    unauthorized = error_response(errors.Unauthorized("no token"))
    assert unauthorized.status_code == 401 and unauthorized.headers["WWW-Authenticate"] == "Bearer"
    failed = error_response(errors.EncodeFailed("secret internals", "r"))
    assert failed.status_code == 500 and b"secret" not in failed.body


def test_lost_staged_embeddings_read_the_same_wherever_they_are_found():
    from ray.exceptions import ObjectLostError, OwnerDiedError

    from registry.errors import staged_lost
    from registry.client.receiver import _translate

    expected = staged_lost("r")
    for raised in (ObjectLostError("00" * 28, None, ""), OwnerDiedError("00" * 28, None, "")):
        found = _translate(raised, "r")
        assert (type(found), found.message, found.req_id) == (type(expected), expected.message, "r")
    # What a rank reading them first and one asking afterwards need to know, in one text.
    assert "the node holding them died" in expected.message and "encode the request again" in expected.message
