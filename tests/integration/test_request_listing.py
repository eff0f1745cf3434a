"""GET /v1/requests: live entries and tombstones of every shard, page by page."""

import uuid

import pytest
import ray

from support import image_bytes, image_item


def encode(cluster, req_id):
    body = {"req_id": req_id, "receive_count": 1, "items": [image_item(image_bytes(32, 32, seed=90))]}
    response = cluster.http.post("/v1/encode", json=body)
    assert response.status_code == 200, response.text


def pages(cluster, **params):
    """Every page of the listing with ``params``: the req_ids and states, and how many pages."""
    rows, count, cursor = [], 0, None
    while True:
        response = cluster.http.get("/v1/requests", params={**params, **({"cursor": cursor} if cursor else {})})
        assert response.status_code == 200, response.text
        page = response.json()
        assert len(page["requests"]) <= params.get("limit", 100)
        rows += [(entry["req_id"], entry["state"]) for entry in page["requests"]]
        count += 1
        cursor = page["next_cursor"]
        if cursor is None:
            return rows, count


def test_listing_pages_through_every_shard_in_req_id_order(cluster):
    prefix = f"list-{uuid.uuid4().hex[:8]}"
    ids = [f"{prefix}-{i}" for i in range(5)]
    for req_id in ids:
        encode(cluster, req_id)
    for req_id in ids[:2]:
        assert "error" not in ray.get(cluster.ranks[0].fetch.remote(req_id))

    # Only this test's entries are staged (every test leaves the registry empty), spread over shards.
    staged, count = pages(cluster, state="staged", limit=2)
    assert staged == [(req_id, "staged") for req_id in ids[2:]] and count == 2
    everything, _ = pages(cluster, limit=1000)
    names = [req_id for req_id, _ in everything]
    assert names == sorted(set(names))  # in order, none twice across pages and shards
    mine = [row for row in everything if row[0].startswith(prefix)]
    assert mine == [(ids[0], "released"), (ids[1], "released"), *[(req_id, "staged") for req_id in ids[2:]]]
    released, _ = pages(cluster, state="released", limit=1000)
    assert {ids[0], ids[1]} <= {req_id for req_id, _ in released}

    first = cluster.http.get("/v1/requests", params={"state": "staged", "limit": 1}).json()["requests"][0]
    assert first["req_id"] == ids[2] and first["receive_count"] == 1 and first["items"][0]["dtype"] == "bfloat16"
    for req_id in ids[2:]:
        assert cluster.http.delete(f"/v1/requests/{req_id}").status_code == 200


@pytest.mark.parametrize(
    "params",
    [{"state": "done"}, {"limit": 0}, {"limit": 1001}, {"cursor": "%%%"}, {"cursor": "A"}],
)
def test_bad_listing_parameters_are_refused(cluster, params):
    response = cluster.http.get("/v1/requests", params=params)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_request"
