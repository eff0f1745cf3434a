"""Every bad input, over HTTP or from a rank, gets its stable code and status and
changes nothing; the bad-input catalogue in docs/reliability.md lists exactly what is tested."""

import base64
import pathlib
import re

import pytest
import ray

from registry import lookup_registry
from registry.errors import HTTP_STATUS, RegistryError, unwrap
from ray_readings import CycleWatch
from support import image_bytes, image_item, registry_stats

PNG = image_bytes(64, 64, seed=31)
BIG_PNG = image_bytes(256, 256, seed=32)  # over 100 KB: the Ingress stores it in the object store
B64 = base64.b64encode(PNG).decode()


def body(**extra):
    return {"items": [image_item(PNG)], **extra}


CASES = [
    # (id, method, path, kwargs for httpx, status, code, text in message)
    ("malformed JSON", "POST", "/v1/encode", {"content": b'{"items": ['}, 422, "invalid_request", "not valid JSON"),
    ("body not an object", "POST", "/v1/encode", {"json": [1, 2]}, 422, "invalid_request", "JSON object"),
    ("no items", "POST", "/v1/encode", {"json": {}}, 422, "invalid_request", "items: Field required"),
    ("empty items", "POST", "/v1/encode", {"json": {"items": []}}, 422, "invalid_request", "at least 1 item"),
    ("receive_count as string", "POST", "/v1/encode", {"json": body(receive_count="2")}, 422, "invalid_request", "receive_count"),
    ("receive_count zero", "POST", "/v1/encode", {"json": body(receive_count=0)}, 422, "invalid_request", "receive_count"),
    ("huge receive_count", "POST", "/v1/encode", {"json": body(receive_count=10_000)}, 422, "invalid_request", "between 1 and 64"),
    ("bad req_id", "POST", "/v1/encode", {"json": body(req_id="../etc")}, 422, "invalid_request", "req_id"),
    ("unknown field", "POST", "/v1/encode", {"json": body(priority=1)}, 422, "invalid_request", "priority"),
    ("unknown item type", "POST", "/v1/encode", {"json": {"items": [{"type": "audio", "audio": B64}]}}, 422, "invalid_request", "items.0"),
    ("cloud metadata url", "POST", "/v1/encode", {"json": {"items": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}]}}, 422, "invalid_request", "not in allowed_media_domains"),
    ("file outside the media root", "POST", "/v1/encode", {"json": {"items": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}}, 422, "invalid_request", "outside allowed_local_media_path"),
    ("ftp url", "POST", "/v1/encode", {"json": {"items": [{"type": "image_url", "image_url": {"url": "ftp://localhost/x.png"}}]}}, 422, "invalid_request", "not supported"),
    ("not base64", "POST", "/v1/encode", {"json": {"items": [{"type": "image", "image": "%%%"}]}}, 422, "invalid_request", "items[0]"),
    ("not an image", "POST", "/v1/encode", {"json": {"items": [{"type": "image", "image": base64.b64encode(b"hello").decode()}]}}, 422, "invalid_request", "items[0]"),
    ("truncated image", "POST", "/v1/encode", {"json": {"items": [image_item(PNG), image_item(PNG[:300])]}}, 422, "invalid_request", "items[1]"),
    ("stored image, then a bad one", "POST", "/v1/encode", {"json": {"items": [image_item(BIG_PNG), {"type": "image", "image": "%%%"}]}}, 422, "invalid_request", "items[1]"),
    ("stored image, then a truncated one", "POST", "/v1/encode", {"json": {"items": [image_item(BIG_PNG), image_item(PNG[:300])]}}, 422, "invalid_request", "items[1]"),
    ("image too small", "POST", "/v1/encode", {"json": {"items": [image_item(image_bytes(8, 8))]}}, 422, "invalid_request", "at least 16"),
    ("too many items", "POST", "/v1/encode", {"json": {"items": [image_item(PNG)] * 17}}, 422, "invalid_request", "limit is 16"),
    ("item over max_item_bytes", "POST", "/v1/encode", {"json": {"items": [{"type": "image", "image": base64.b64encode(b"x" * (2 * 1024 * 1024 + 1)).decode()}]}}, 422, "invalid_request", "the limit is"),
    ("body over max_request_bytes", "POST", "/v1/encode", {"content": b"x" * (4 * 1024 * 1024 + 1)}, 413, "payload_too_large", "max_request_bytes"),
    ("unknown id", "GET", "/v1/requests/never-seen", {}, 404, "unknown_request", "never-seen"),
    ("cancel unknown id", "DELETE", "/v1/requests/never-seen", {}, 404, "unknown_request", "never-seen"),
    ("negative wait_s", "GET", "/v1/requests/x?wait_s=-1", {}, 422, "invalid_request", "wait_s"),
    ("wait_s not a number", "GET", "/v1/requests/x?wait_s=soon", {}, 422, "invalid_request", "wait_s"),
    ("wrong API token", "GET", "/v1/stats", {"headers": {"Authorization": "Bearer not-the-token"}}, 401, "unauthorized", "API token"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_its_code_and_stages_nothing(cluster, case):
    _, method, path, kwargs, status, code, text = case
    before = registry_stats()
    response = cluster.http.request(method, path, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and text in error["message"], error
    after = registry_stats()
    assert (after["pending"], after["staged"]) == (0, 0)
    assert after["staged_total"] == before["staged_total"]


def test_failed_encode_leaves_a_failed_tombstone(cluster):
    response = cluster.http.post(
        "/v1/encode", json={"req_id": "bad-image-1", "items": [{"type": "image", "image": base64.b64encode(b"junk").decode()}]}
    )
    assert response.status_code == 422
    described = cluster.http.get("/v1/requests/bad-image-1").json()
    assert described["state"] == "failed" and described["error"]["code"] == "invalid_request"
    # A corrected retry with the same req_id is accepted.
    retry = cluster.http.post("/v1/encode", json={"req_id": "bad-image-1", "receive_count": 1, "items": [image_item(PNG)]})
    assert retry.status_code == 200
    assert cluster.http.delete("/v1/requests/bad-image-1").json()["state"] == "cancelled"


def test_a_failed_encode_leaves_no_reference_cycle_in_the_encoder_or_the_registry(cluster):
    """A failed item's frames hold its input (the request's bytes, or the ref to its stored
    copy): a cycle through them would keep it until a collection happened to run."""
    with CycleWatch.of_app("epd", ("Ingress", "Encoder"), others=(lookup_registry(req_id="cycle-1"),)) as watch:
        response = cluster.http.post("/v1/encode", json={
            "req_id": "cycle-1", "receive_count": 1, "items": [image_item(BIG_PNG), image_item(PNG[:300])]})
        assert response.status_code == 422, response.text
    assert watch.found == [[]] * len(watch.actors)


RANK_CASES = [
    # (id, rank, timeout_s, code, text in message): a rank's fetch of a staged entry with receive_count 2
    ("rank fetch: negative rank", -1, 1.0, "invalid_rank", "integer >= 0"),
    ("rank fetch: rank not below receive_count", 2, 1.0, "invalid_rank", "ranks are 0..1"),
    ("rank fetch: rank not an integer", "0", 1.0, "invalid_rank", "integer >= 0"),
    ("rank fetch: negative timeout_s", 0, -1.0, "invalid_request", "timeout_s"),
    ("rank fetch: timeout_s not a number", 0, float("nan"), "invalid_request", "timeout_s"),
    ("rank fetch: timeout_s over an hour", 0, 7200.0, "invalid_request", "timeout_s"),
]


@pytest.mark.parametrize("case", RANK_CASES, ids=[c[0] for c in RANK_CASES])
def test_bad_fetch_gets_its_code_and_counts_no_rank(cluster, case):
    _, rank, timeout_s, code, text = case
    staged = cluster.http.post("/v1/encode", json=body(receive_count=2)).json()
    with pytest.raises(RegistryError) as info:
        ray.get(lookup_registry(req_id=staged["req_id"]).fetch.remote(staged["req_id"], rank, timeout_s))
    error = unwrap(info.value)
    assert error.code == code and text in error.message, error.message
    described = cluster.http.get(f"/v1/requests/{staged['req_id']}").json()
    assert described["state"] == "staged" and described["received_ranks"] == []
    cluster.http.delete(f"/v1/requests/{staged['req_id']}")


def test_the_documented_catalogue_lists_exactly_the_tested_bad_inputs(cluster):
    catalogue_doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    section = catalogue_doc.split("### Bad-input catalogue", 1)[1].split("\n#", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| bad input")]
    listed = {(name, code.strip("`"), int(status)) for name, code, status, where in rows if where == "`test_http_errors.py`"}
    tested = {(c[0], c[5], c[4]) for c in CASES} | {(c[0], c[3], HTTP_STATUS[c[3]]) for c in RANK_CASES}
    assert listed == tested
    tests_dir = pathlib.Path(__file__).resolve().parents[1]
    for name, code, status, where in rows:
        assert HTTP_STATUS[code.strip("`")] == int(status), name
        if where != "`test_http_errors.py`":  # another test: `file::function`
            path, function = re.fullmatch(r"`(\S+)::(\w+)`", where).groups()
            assert f"def {function}(" in next(tests_dir.rglob(path)).read_text(), where
