"""How the registry names what an item's encode raised (no cluster needed)."""

from ray.serve.exceptions import BackPressureError

from registry.encoding import encode_error as _encode_error
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
