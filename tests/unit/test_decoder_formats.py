"""What decoders outside Ray receive: the safetensors file of the HTTP pull, the ZMQ push's
endpoint policy, and items built from raw buffers."""

import ipaddress
import json
import struct

import numpy as np
import pytest
import safetensors.torch
import torch

from deployments.config import AppConfig
from deployments.tensor_file import safetensors_bytes
from deployments.zmq_push import check_endpoint
from encoder.types import tensor_to_payload
from registry.errors import InvalidRequest, Unavailable
from registry.client.received_item import item_from_buffer
from registry.client.zmq_receiver import ZmqEmbeddingReceiver, _error_from


def _items(*tensors):
    return [({"index": i, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "nbytes": t.nbytes,
              "grid": [1, 2]}, tensor_to_payload(t)) for i, t in enumerate(tensors)]


def test_the_pull_file_loads_with_safetensors_bit_for_bit_in_every_dtype():
    tensors = [torch.randn(5, 7).to(torch.bfloat16), torch.randn(3, 4), torch.randn(2, 2, 3).half()]
    body = safetensors_bytes("req-1", _items(*tensors))
    loaded = safetensors.torch.load(body)
    for i, tensor in enumerate(tensors):
        assert loaded[f"item_{i}"].dtype == tensor.dtype and torch.equal(loaded[f"item_{i}"], tensor)
    (size,) = struct.unpack("<Q", body[:8])
    assert size % 8 == 0  # the data starts aligned
    header = json.loads(body[8 : 8 + size])
    assert header["__metadata__"]["req_id"] == "req-1" and header["__metadata__"]["count"] == "3"
    assert json.loads(header["__metadata__"]["item_0"])["grid"] == [1, 2]


def test_an_empty_request_and_an_unknown_dtype():
    assert safetensors.torch.load(safetensors_bytes("r", [])) == {}
    with pytest.raises(ValueError, match="dtype"):
        safetensors_bytes("r", [({"dtype": "int8", "shape": [1]}, np.zeros(1, np.int8))])


LOOPBACK = AppConfig().push_networks()


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://127.9.0.1:1", "tcp://[::1]:65535"])
def test_push_endpoints_inside_the_policy(endpoint):
    assert check_endpoint(endpoint, LOOPBACK, "r") == endpoint


@pytest.mark.parametrize(
    "endpoint, why",
    [
        ("tcp://10.0.0.1:5555", "outside push_allowed_networks"),
        ("tcp://169.254.169.254:80", "outside push_allowed_networks"),
        ("tcp://localhost:5555", "tcp://<IP address>:<port>"),  # names are not looked up
        ("ipc:///tmp/socket", "tcp://<IP address>:<port>"),
        ("tcp://127.0.0.1:0", "port"),
        ("tcp://127.0.0.1:99999", "port"),
        ("tcp://999.1.1.1:5", "valid IP"),
        ("tcp://127.0.0.1:5555\n", "tcp://<IP address>:<port>"),
        (5555, "tcp://<IP address>:<port>"),
    ],
)
def test_push_endpoints_outside_the_policy_are_refused(endpoint, why):
    with pytest.raises(InvalidRequest, match=why):
        check_endpoint(endpoint, LOOPBACK, "r")


def test_the_policy_is_configurable_and_checked_at_load():
    networks = AppConfig(push_allowed_networks=["10.0.0.0/8"]).push_networks()
    assert networks == [ipaddress.ip_network("10.0.0.0/8")]
    assert check_endpoint("tcp://10.1.2.3:7000", networks, "r")
    with pytest.raises(ValueError, match="push_allowed_networks"):
        AppConfig(push_allowed_networks=["10.0.0.0/33"])


def test_items_view_their_buffer_and_copy_only_when_misaligned():
    tensor = torch.randn(4, 6).to(torch.bfloat16)
    raw = bytearray(tensor_to_payload(tensor).tobytes())
    item = item_from_buffer(raw, {"dtype": "bfloat16", "shape": [4, 6]})
    assert torch.equal(item.tensor, tensor)
    raw[0:2] = b"\x00\x00"
    assert item.tensor.view(torch.int16)[0, 0] == 0  # a view of the buffer, not a copy
    values = torch.randn(3)
    shifted = bytearray(1) + bytearray(tensor_to_payload(values).tobytes())  # one byte off alignment
    moved = item_from_buffer(memoryview(shifted)[1:], {"dtype": "float32", "shape": [3]}).tensor
    assert moved.data_ptr() % 4 == 0 and torch.equal(moved, values)
    with pytest.raises(ValueError, match="dtype"):
        item_from_buffer(raw, {"dtype": "int64", "shape": [4, 6]})
    with pytest.raises(ValueError, match=r"shape \[4, 7\] holds 28 bfloat16 values; the bytes hold 24"):
        item_from_buffer(raw, {"dtype": "bfloat16", "shape": [4, 7]})


def test_the_receiver_turns_service_answers_into_the_service_errors():
    body = json.dumps({"error": {"code": "expired", "message": "gone", "req_id": "r", "details": {"x": 1}}}).encode()
    error = _error_from(410, body, "r")
    assert error.code == "expired" and error.message == "gone" and error.details == {"x": 1}
    assert _error_from(502, b"<html>bad gateway</html>", "r").code == "unavailable"
    with ZmqEmbeddingReceiver(rank=0, url="http://127.0.0.1:9") as rx:  # nothing listens on port 9
        assert rx.endpoint.startswith("tcp://127.0.0.1:")
        with pytest.raises(Unavailable, match="not reachable"):
            rx.fetch("r", timeout_s=1)
    with pytest.raises(ValueError, match="rank"):
        ZmqEmbeddingReceiver(rank=-1)


def test_a_receiver_bound_to_a_wildcard_advertises_the_address_it_is_given():
    with ZmqEmbeddingReceiver(rank=1, bind="tcp://0.0.0.0:0", advertise="127.0.0.1") as rx:
        port = int(rx.endpoint.rsplit(":", 1)[1])
        assert rx.endpoint == f"tcp://127.0.0.1:{port}" and port > 0
    with pytest.raises(ValueError, match="advertise"):
        ZmqEmbeddingReceiver(rank=0, bind="tcp://0.0.0.0:0")


def test_a_receiver_drops_whatever_is_not_an_item_of_its_delivery():
    import zmq

    tensor = torch.randn(2, 3).to(torch.bfloat16)
    meta = {"index": 0, "shape": [2, 3], "dtype": "bfloat16"}
    with ZmqEmbeddingReceiver(rank=0) as rx:
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(rx.endpoint)
        try:
            good = json.dumps({"req_id": "r", "delivery": "d", "index": 0, "count": 1, "meta": meta}).encode()
            for junk in ([b"one frame"], [b"not json", b"x"], [b"[]", b"x"], [good.replace(b'"d"', b'"old"'), b"x"],
                         [good.replace(b'"index": 0', b'"index": 7'), b"x"], [b"{}", b"x", b"x"],
                         [good, tensor_to_payload(tensor).tobytes()[:8]]):  # bytes that do not fill its shape
                push.send_multipart(junk)
            push.send_multipart([good, tensor_to_payload(tensor).tobytes()])
            items = rx._collect("r", "d", 1)
        finally:
            push.close(linger=0)
    assert items is not None and torch.equal(items[0].tensor, tensor) and items[0].meta == meta


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://host/", "http://"])
def test_a_receiver_needs_an_http_url(url):
    with pytest.raises(ValueError, match="url"):
        ZmqEmbeddingReceiver(rank=0, url=url)
