"""The HTTP pull (``GET /v1/requests/{req_id}/items?rank=N``): a rank is counted only once it
has the items, at its acknowledgement or ``http_pull_grace_s`` after its last pull (3 s for
the suite's app), so a pull that fails mid-way is answered again and never releases the entry.
"""

import json
import socket
import time
import urllib.parse
import uuid

import safetensors

from test_outside_ray import EXPECTED, IMAGES, encode, pull, pulled_digests  # pytest imports test files by name
from support import image_item, wait_until


def described(cluster, req_id) -> dict:
    return cluster.http.get(f"/v1/requests/{req_id}").json()


def acknowledge(cluster, req_id, rank) -> dict:
    response = cluster.http.post(f"/v1/requests/{req_id}/acknowledge", json={"rank": rank})
    assert response.status_code == 200, response.text
    return response.json()


def ranks_of(cluster, req_id) -> tuple[str, list[int], list[int]]:
    out = described(cluster, req_id)
    return out["state"], out["received_ranks"], out["delivering_ranks"]


def _raw_pull(cluster, req_id: str, rank: int, body_bytes: int) -> bytes:
    """A pull over a socket of its own that reads the response's headers and ``body_bytes``
    of its body, then closes: a client whose connection dropped (0), or whose read gave up
    mid-body (a timeout). Returns what it read."""
    url = urllib.parse.urlsplit(cluster.url)
    request = (f"GET /v1/requests/{req_id}/items?rank={rank} HTTP/1.1\r\nHost: {url.hostname}\r\n"
               f"Authorization: {cluster.headers['Authorization']}\r\nConnection: close\r\n\r\n")
    with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
        conn.sendall(request.encode())
        read = b""
        while b"\r\n\r\n" not in read or len(read.split(b"\r\n\r\n", 1)[1]) < body_bytes:
            chunk = conn.recv(1024)
            assert chunk, f"the connection closed after {read[:300]!r}"
            read += chunk
    head, _, body = read.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return body[:body_bytes]


def test_a_pull_whose_connection_drops_after_the_headers_is_answered_again_and_released_only_after(cluster):
    req_id = encode(cluster, receive_count=1, prefix="drop")
    assert _raw_pull(cluster, req_id, 0, body_bytes=0) == b""
    # The service sent the file; whether it arrived it cannot know: rank 0 is not counted.
    assert ranks_of(cluster, req_id) == ("staged", [], [0])
    again = pull(cluster, req_id, 0)
    assert again.status_code == 200 and pulled_digests(again.content) == EXPECTED
    assert ranks_of(cluster, req_id) == ("staged", [], [0])
    assert acknowledge(cluster, req_id, 0) == {"req_id": req_id, "rank": 0, "released": True}
    assert ranks_of(cluster, req_id) == ("released", [0], [])


def test_a_pull_that_gives_up_mid_body_is_answered_again_and_released_only_after(cluster):
    req_id = encode(cluster, receive_count=2, prefix="midbody")
    assert len(_raw_pull(cluster, req_id, 1, body_bytes=4096)) == 4096
    assert ranks_of(cluster, req_id) == ("staged", [], [1])
    first = pull(cluster, req_id, 0)
    assert acknowledge(cluster, req_id, 0)["released"] is False  # rank 1 is not counted yet
    assert ranks_of(cluster, req_id) == ("staged", [0], [1])
    retry = pull(cluster, req_id, 1)
    assert retry.status_code == 200 and retry.content == first.content and pulled_digests(retry.content) == EXPECTED
    assert acknowledge(cluster, req_id, 1)["released"] is True
    assert ranks_of(cluster, req_id) == ("released", [0, 1], [])
    late = pull(cluster, req_id, 1)
    assert late.status_code == 410 and late.json()["error"]["code"] == "already_released"


def test_a_plain_client_that_never_acknowledges_is_counted_after_the_grace(cluster):
    grace = cluster.app_args["http_pull_grace_s"]
    req_id = encode(cluster, receive_count=2, prefix="plain")
    pulled_at = time.monotonic()
    for rank in (0, 1):
        assert pull(cluster, req_id, rank).status_code == 200
    assert ranks_of(cluster, req_id) == ("staged", [], [0, 1])
    final = wait_until(lambda: (d := described(cluster, req_id))["state"] != "staged" and d, grace + 10,
                       what="the entry to be released after the grace")
    waited = time.monotonic() - pulled_at
    assert final["state"] == "released" and final["received_ranks"] == [0, 1], final
    assert grace - 0.5 <= waited < grace + 5, waited  # at the grace's end, not at the ttl


def test_http_pull_with_tp2_follows_the_release_rule(cluster, tmp_path):
    req_id = encode(cluster, receive_count=2)
    first = pull(cluster, req_id, 0)
    assert first.status_code == 200 and first.headers["content-type"] == "application/octet-stream"
    assert pulled_digests(first.content) == EXPECTED
    assert acknowledge(cluster, req_id, 0)["released"] is False
    assert ranks_of(cluster, req_id) == ("staged", [0], [])
    again = pull(cluster, req_id, 0)  # a repeated pull by a counted rank: the same file, not counted twice
    assert again.content == first.content and ranks_of(cluster, req_id) == ("staged", [0], [])
    second = pull(cluster, req_id, 1)
    assert second.content == first.content
    assert acknowledge(cluster, req_id, 1)["released"] is True
    assert ranks_of(cluster, req_id) == ("released", [0, 1], [])
    late = pull(cluster, req_id, 0)
    assert late.status_code == 410 and late.json()["error"]["code"] == "already_released"

    path = tmp_path / "items.safetensors"
    path.write_bytes(first.content)
    with safetensors.safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    metas = [json.loads(metadata[f"item_{i}"]) for i in range(2)]
    assert metadata["req_id"] == req_id and metadata["count"] == "2"
    assert [m["index"] for m in metas] == [0, 1] and [m["shape"] for m in metas] == [[140, 512], [16, 512]]
    assert all(m["dtype"] == "bfloat16" for m in metas)


def test_http_pull_waits_while_pending_and_refuses_bad_ranks(cluster):
    req_id = f"pull-wait-{uuid.uuid4().hex[:8]}"
    body = {"req_id": req_id, "receive_count": 1, "items": [image_item(IMAGES[0])], "wait": False}
    assert cluster.http.post("/v1/encode", json=body).status_code in (200, 202)
    bad = pull(cluster, req_id, 1, timeout_s=30)
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_rank"
    response = pull(cluster, req_id, 0, timeout_s=30)
    assert response.status_code == 200 and pulled_digests(response.content) == EXPECTED[:1]
    assert acknowledge(cluster, req_id, 0)["released"] is True
    never = f"never-{uuid.uuid4().hex[:8]}"
    unknown = pull(cluster, never, 0, timeout_s=30)  # never seen: at once, not after timeout_s
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_request"
    late = pull(cluster, never, 0, timeout_s=0, wait_for_submit="true")  # asked to wait for a submit: none came
    assert late.status_code == 504 and late.json()["error"]["code"] == "not_ready"
