"""SGLang's encoder protocol under /sglang, spoken by a client written from SGLang 0.5.23's
wire format (tests/e2e/test_sglang.py runs SGLang's own receiver against it).

Ranks are PULL sockets in this process; frame 0 is loaded through an allowlist as
SGLang's ``safe_pickle_loads`` does (``tests/sglang_frames.py``).
"""

import concurrent.futures
import time
import uuid

import httpx
import pytest
import torch
import zmq

from sglang_frames import Modality, PullRank, embedding, load_header
from support import MODEL_SPEC, data_url, image_bytes, reference_embedding, registry_stats, wait_until

IMAGES = [image_bytes(224, 160, seed=91), image_bytes(64, 64, seed=92)]
REFERENCE = [torch.from_numpy(reference_embedding(d, **MODEL_SPEC)).view(torch.bfloat16) for d in IMAGES]


@pytest.fixture
def ranks():
    context = zmq.Context()
    made = [PullRank(context) for _ in range(3)]
    yield made
    for rank in made:
        rank.close()
    context.term()


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(8) as executor:
        yield executor


def part_id() -> str:
    return f"sgl-{uuid.uuid4().hex[:12]}_local_part_0"


def encode_body(req_id: str, images: list[bytes], **fields) -> dict:
    return {
        "encoder_idx": 0, "encoder_url": "http://unused", "mm_items": [data_url(d) for d in images],
        "num_parts": 1, "part_idx": 0, "req_id": req_id, "modality": "IMAGE",
        "prefill_host": "127.0.0.1", "embedding_port": None, "time_stats_json": None, **fields,
    }


def post(cluster, path: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=cluster.url, headers=cluster.headers, timeout=60) as http:
        return http.post(f"/sglang{path}", json=body)


def register(cluster, req_id: str, rank: PullRank, receive_count: int = 2) -> httpx.Response:
    body = {"req_id": req_id, "receive_count": receive_count, "receive_url": rank.receive_url, "modality": "IMAGE"}
    return post(cluster, "/scheduler_receive_url", body)


def entry(cluster, req_id: str) -> dict:
    return cluster.http.get(f"/v1/requests/{req_id}").json()


def test_tp2_ranks_each_get_the_part_once_and_the_second_releases(cluster, ranks, pool):
    req_id = part_id()
    early = pool.submit(register, cluster, req_id, ranks[0])  # before /encode: waits for it
    encode = pool.submit(post, cluster, "/encode", encode_body(req_id, IMAGES[:1]))
    assert early.result(30).status_code == 200
    assert register(cluster, req_id, ranks[0]).status_code == 200  # a repeat: the same rank
    assert entry(cluster, req_id)["state"] in ("pending", "staged")
    assert register(cluster, req_id, ranks[1]).status_code == 200
    answer = encode.result(60)
    assert answer.status_code == 200 and answer.json() is None
    for rank in ranks[:2]:
        frames = rank.receive()
        assert frames is not None and len(frames) == 2
        header = load_header(frames[0])
        assert (header.req_id, header.num_parts, header.part_idx) == (req_id, 1, 0)
        assert header.modality is Modality.IMAGE and header.error_msg is None and header.embedding is None
        assert header.dtype is torch.bfloat16 and header.shape == list(REFERENCE[0].shape)
        assert torch.equal(embedding(header, frames[1]), REFERENCE[0])
        assert rank.receive(0.2) is None  # one message per rank
    described = entry(cluster, req_id)
    assert (described["state"], described["received_ranks"], described["receive_count"]) == ("released", [0, 1], 2)


def test_two_images_in_one_part_arrive_as_one_tensor(cluster, ranks, pool):
    req_id = part_id()
    encode = pool.submit(post, cluster, "/encode", encode_body(req_id, IMAGES))
    assert register(cluster, req_id, ranks[0], receive_count=1).status_code == 200
    assert encode.result(60).status_code == 200
    frames = ranks[0].receive()
    header = load_header(frames[0])
    assert torch.equal(embedding(header, frames[1]), torch.cat(REFERENCE))
    grids = [item.get("grid_thw") for item in entry(cluster, req_id)["items"]]
    assert header.grid_dim is None if None in grids else header.grid_dim.tolist() == grids
    assert entry(cluster, req_id)["state"] == "released"


def test_a_late_rank_is_refused_at_once_and_counts_are_checked(cluster, ranks, pool):
    req_id = part_id()
    encode = pool.submit(post, cluster, "/encode", encode_body(req_id, IMAGES[:1]))
    assert register(cluster, req_id, ranks[0]).status_code == 200
    inconsistent = register(cluster, req_id, ranks[1], receive_count=3)
    assert inconsistent.status_code == 400 and "Inconsistent receive_count" in inconsistent.json()["message"]
    assert inconsistent.json()["status"] == "error" and inconsistent.json()["req_id"] == req_id
    assert register(cluster, req_id, ranks[1]).status_code == 200  # the second: released once pushed
    assert encode.result(60).status_code == 200
    started = time.monotonic()
    late = register(cluster, req_id, ranks[2])
    assert late.status_code == 410 and "released" in late.json()["message"]
    assert time.monotonic() - started < 5
    assert entry(cluster, req_id)["received_ranks"] == [0, 1]


@pytest.mark.parametrize("rank_first", [True, False], ids=["registered-first", "registered-after"])
def test_a_corrupt_image_makes_every_rank_abort_with_the_reason(cluster, ranks, pool, rank_first):
    req_id = part_id()
    body = encode_body(req_id, [IMAGES[0][:300]])
    early = pool.submit(register, cluster, req_id, ranks[0]) if rank_first else None
    if early is not None:  # the registration is waiting for the part when it fails
        wait_until(lambda: registry_stats()["waiting_calls"] >= 1, 15, what="the registration to wait")
    answer = post(cluster, "/encode", body)
    assert answer.status_code == 400 and "items[0]" in answer.json()["message"]
    late = register(cluster, req_id, ranks[1])
    assert late.status_code == 200  # told through its socket, as a rank registered in time is
    for rank in [ranks[0], ranks[1]] if early is not None else [ranks[1]]:
        frames = rank.receive()
        assert frames is not None and len(frames) == 1
        header = load_header(frames[0])
        assert "items[0]" in header.error_msg and header.error_code == 400 and header.req_id == req_id
    if early is not None:
        assert early.result(30).status_code == 200
    assert entry(cluster, req_id)["state"] == "failed"


def test_zmq_to_tokenizer_pushes_the_one_copy_to_the_tokenizer(cluster, ranks):
    req_id = part_id()
    port = int(ranks[0].receive_url.rsplit(":", 1)[1])
    answer = post(cluster, "/encode", encode_body(req_id, IMAGES[1:], embedding_port=port))
    assert answer.status_code == 200 and answer.json() is None
    frames = ranks[0].receive()
    header = load_header(frames[0])
    assert header.req_id == req_id and torch.equal(embedding(header, frames[1]), REFERENCE[1])
    assert entry(cluster, req_id)["received_ranks"] == [0]


@pytest.mark.parametrize(
    ("path", "body", "text"),
    [
        ("/encode", {"req_id": "x_local_part_0", "mm_items": []}, "mm_items"),
        ("/encode", encode_body("v_local_part_0", IMAGES[:1], modality="VIDEO"), "VIDEO"),
        ("/encode", encode_body("p_local_part_0", IMAGES[:1], part_idx=3), "part_idx"),
        ("/encode", encode_body("h_local_part_0", IMAGES[:1], embedding_port=5555, prefill_host="10.9.8.7"), "push_allowed_networks"),
        ("/scheduler_receive_url", {"req_id": "r_local_part_0", "receive_count": 2, "receive_url": "10.9.8.7:5555"}, "push_allowed_networks"),
        ("/scheduler_receive_url", {"req_id": "n_local_part_0", "receive_count": 2, "receive_url": "localhost:5555"}, "IP address"),
        ("/scheduler_receive_url", {"req_id": "c_local_part_0", "receive_count": 0, "receive_url": "127.0.0.1:5555"}, "receive_count"),
        ("/scheduler_receive_url", {"req_id": "l\nforged", "receive_count": 1, "receive_url": "127.0.0.1:5555"}, "req_id"),
    ],
    ids=["no-items", "video", "part-idx", "tokenizer-outside-policy", "rank-outside-policy", "host-name", "count-0", "control-chars"],
)
def test_bad_bodies_get_sglangs_error_shape(cluster, path, body, text):
    answer = post(cluster, path, body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["status"] == "error" and text in answer.json()["message"]


def test_health_answers_as_sglang_probes_it(cluster):
    assert httpx.get(f"{cluster.url}/sglang/health", timeout=30).status_code == 200
