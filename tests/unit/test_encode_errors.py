"""How the registry names what an item's encode raised (no cluster needed)."""

from ray.serve.exceptions import BackPressureError

from registry.server.encodes import encode_error as _encode_error
from registry.errors import EncodeFailed, InvalidRequest, Overloaded


class _RayStyleWrapper(Exception):
    """Ray re-raises an actor's exception wrapped, with the original as ``.cause``."""

    def __init__(self, cause):
        super().__init__(str(cause))
        self.cause = cause


def test_item_errors_name_the_item_and_keep_their_code():
    err = _encode_error(_RayStyleWrapper(InvalidRequest("the image is empty")), "r1", 3)
    assert isinstance(err, InvalidRequest) and err.message == "items[3]: the image is empty" and err.req_id == "r1"


def test_serve_backpressure_is_overloaded():
    err = _encode_error(BackPressureError(num_queued_requests=10, max_queued_requests=10), "r1", 0)
    assert isinstance(err, Overloaded) and err.code == "overloaded" and "retry later" in err.message


def test_anything_else_is_encode_failed_with_the_cause():
    err = _encode_error(RuntimeError("CUDA error: out of memory"), "r1", 1)
    assert isinstance(err, EncodeFailed) and "RuntimeError: CUDA error" in err.message
    assert "CUDA" not in err.to_dict(mask=True)["error"]["message"]


def test_a_model_exception_raised_in_the_replica_is_named_not_ray_s_wrapper():
    err = _encode_error(_RayStyleWrapper(ValueError("pixel_values has 3 dims, want 4")), "r1", 0)
    assert isinstance(err, EncodeFailed) and err.message == "items[0]: ValueError: pixel_values has 3 dims, want 4"


def test_a_replica_dying_again_on_the_retry_is_retryable_unavailable():
    from ray.exceptions import ActorDiedError

    from registry.errors import Unavailable, http_status

    err = _encode_error(ActorDiedError(), "r1", 2)
    assert isinstance(err, Unavailable) and http_status(err) == 503
    assert err.message.startswith("items[2]: the encoder replica died") and "retry" in err.message


def test_an_input_lost_with_its_owner_is_retryable_unavailable():
    from ray.exceptions import OwnerDiedError

    from registry.errors import Unavailable, http_status

    err = _encode_error(OwnerDiedError("ab" * 28, None, ""), "r1", 0)  # raised as is by the awaited ref
    assert isinstance(err, Unavailable) and http_status(err) == 503
    assert err.message.startswith("items[0]: the input bytes were lost") and "retry" in err.message
