"""SGLang's wire format as the service writes it: the pickled EmbeddingData header (loaded
through an allowlist as SGLang's ``safe_pickle_loads`` does), the part's bytes, endpoints,
statuses and the text ranks are told."""

import pickle
import pickletools

import numpy as np
import pytest
import torch

from deployments import sglang_wire as wire
from registry.errors import EncodeFailed, InvalidRequest, Overloaded, Unavailable
from sglang_frames import EmbeddingData, Modality, embedding, load_header


def part(**fields):
    body = {"req_id": "rid-1_local_part_1", "mm_items": ["data:image/png;base64,AA=="], "num_parts": 2, "part_idx": 1}
    return wire.parse(wire.EncodePart, {**body, **fields})


def test_the_header_names_only_globals_sglangs_allowlist_has():
    frame = wire.header("r_local_part_0", 2, 1, "VIDEO", grid_thw=[[1, 4, 6], [2, 2, 2]], dtype="bfloat16", shape=[40, 64])
    names = {arg for op, arg, _ in pickletools.genops(frame) if op.name in ("SHORT_BINUNICODE", "BINUNICODE")}
    assert {"sglang.srt.disaggregation.encoder.receiver", "EmbeddingData", "torch", "LongTensor", "bfloat16"} <= names
    header = load_header(frame)
    assert isinstance(header, EmbeddingData)
    assert vars(header) | {"send_time": None} == {
        "req_id": "r_local_part_0", "num_parts": 2, "part_idx": 1, "grid_dim": header.grid_dim, "modality": Modality.VIDEO,
        "embedding": None, "send_time": None, "dtype": torch.bfloat16, "shape": [40, 64], "_mr_ptr": None,
        "error_msg": None, "error_code": None,
    }
    assert header.grid_dim.dtype == torch.int64 and header.grid_dim.tolist() == [[1, 4, 6], [2, 2, 2]]
    assert isinstance(header.send_time, float)


def test_the_header_does_not_load_without_the_allowlist_entries():
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(wire.header("r", 1, 0, "IMAGE"))  # SGLang's class, which this process lacks


@pytest.mark.parametrize("text", ["short", "x" * 300, "ünïcødé"])
def test_an_error_header_carries_the_text_and_status(text):
    header = load_header(wire.error_frames("r_local_part_0", 1, 0, "AUDIO", InvalidRequest(text, "r"))[0])
    assert (header.error_msg, header.error_code, header.modality, header.shape) == (text, 400, Modality.AUDIO, None)


def test_part_frames_join_the_items_along_the_tokens():
    a = torch.randn(4, 8).to(torch.bfloat16)
    b = torch.randn(6, 8).to(torch.bfloat16)
    items = [
        ({"shape": [4, 8], "dtype": "bfloat16", "grid_thw": [1, 4, 4]}, a.view(torch.int16).numpy()),
        ({"shape": [6, 8], "dtype": "bfloat16", "grid_thw": [1, 6, 4]}, b.view(torch.int16).numpy()),
    ]
    frames = wire.part_frames(part(), items)
    header = load_header(frames[0])
    assert header.shape == [10, 8] and header.grid_dim.tolist() == [[1, 4, 4], [1, 6, 4]]
    assert torch.equal(embedding(header, bytes(frames[1])), torch.cat([a, b]))
    with pytest.raises(InvalidRequest, match="differ in dtype or width"):
        wire.part_frames(part(), [items[0], ({"shape": [2, 4], "dtype": "float32"}, np.zeros((2, 4), np.float32))])


def test_a_tower_without_a_grid_sends_none():
    frames = wire.part_frames(part(), [({"shape": [3, 2], "dtype": "float32"}, np.ones((3, 2), np.float32))])
    assert load_header(frames[0]).grid_dim is None


@pytest.mark.parametrize(
    ("given", "expected"),
    [("127.0.0.1:5000", "tcp://127.0.0.1:5000"), ("[::1]:5000", "tcp://[::1]:5000"), ("::1:5000", "tcp://[::1]:5000"),
     ("host:5000", "tcp://host:5000")],
)
def test_receive_urls_become_tcp_endpoints(given, expected):
    assert wire.tcp_endpoint(given, "r") == expected


@pytest.mark.parametrize("given", ["127.0.0.1", ":5000", "127.0.0.1:port", ""])
def test_malformed_receive_urls_are_refused(given):
    with pytest.raises(InvalidRequest, match="host:port"):
        wire.tcp_endpoint(given, "r")


def test_statuses_are_sglangs_and_5xx_texts_are_masked():
    assert wire.status("invalid_request") == 400 and wire.status("already_released") == 410
    assert wire.status("overloaded") == 429 and wire.status("no_such_code") == 500
    failed = EncodeFailed("encoding r failed: [invalid_request] items[0]: bad", "r", {"cause": {"code": "invalid_request", "message": "items[0]: bad"}})
    assert wire.rank_error(failed) == ("items[0]: bad", 400)
    crashed = EncodeFailed("encoding r failed: CUDA error", "r", {"cause": {"code": "internal", "message": "CUDA error"}})
    assert "CUDA" not in wire.rank_error(crashed)[0] and wire.rank_error(crashed)[1] == 500
    assert wire.rank_error(Overloaded("busy", "r")) == ("busy", 429)
    assert wire.rank_error(Unavailable("down", "r"))[1] == 503


@pytest.mark.parametrize(
    ("fields", "text"),
    [({"modality": "VIDEO"}, "VIDEO"), ({"part_idx": 2}, "part_idx"), ({"mm_items": [{"format": "png"}]}, r"mm_items\[0\]")],
)
def test_parts_this_service_cannot_encode_are_refused(fields, text):
    with pytest.raises(InvalidRequest, match=text):
        wire.image_items(part(**fields))


def test_unknown_fields_are_ignored_and_items_become_image_urls():
    parsed = part(hashes=["h"], time_stats_json="{}", mm_items=["u1", {"url": "u2"}], something_new=1)
    assert wire.image_items(parsed) == [
        {"type": "image_url", "image_url": {"url": "u1"}}, {"type": "image_url", "image_url": {"url": "u2"}},
    ]
