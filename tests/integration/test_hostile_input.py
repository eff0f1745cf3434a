"""Whatever a client sends (any body, header or path, on every route) gets a 4xx with the
error body, never a 5xx, and nothing is staged (the suite's no_leaks fixture checks that)."""

import base64

import pytest

from support import image_bytes, image_item

PNG = image_bytes(64, 64, seed=41)


def encode_body(**fields):
    return {"items": [image_item(PNG)], **fields}


NESTED = [
    ("list nested 100,000 deep", b"[" * 100_000),
    ("object nested 50,000 deep", b'{"a":' * 50_000),
    ("items nested 100,000 deep", b'{"items": ' + b"[" * 100_000),
    ("valid JSON nested 3,000 deep", b'{"items": ' + b"[" * 3_000 + b"]" * 3_000 + b"}"),
]
WRONG_TYPES = [
    ("req_id number", encode_body(req_id=5)),
    ("req_id list", encode_body(req_id=["a"])),
    ("req_id 10,000 characters", encode_body(req_id="a" * 10_000)),
    ("req_id with a newline", encode_body(req_id="a\nb")),
    ("req_id with a NUL", encode_body(req_id="a\x00b")),
    ("req_id non-ASCII", encode_body(req_id="ünïcode")),
    ("receive_count float", encode_body(receive_count=2.5)),
    ("receive_count bool", encode_body(receive_count=True)),
    ("receive_count huge", encode_body(receive_count=10**40)),
    ("wait string", encode_body(wait="yes")),
    ("items object", {"items": {"0": image_item(PNG)}}),
    ("items of numbers", {"items": [1, 2]}),
    ("item without type", {"items": [{"image_url": {"url": "x"}}]}),
    ("item type number", {"items": [{"type": 7}]}),
    ("image_url a string", {"items": [{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}]}),
    ("url a number", {"items": [{"type": "image_url", "image_url": {"url": 5}}]}),
    ("url empty", {"items": [{"type": "image_url", "image_url": {"url": ""}}]}),
    ("url with control characters", {"items": [{"type": "image_url", "image_url": {"url": "http://x/\r\nHost: evil"}}]}),
    ("url 100,000 characters", {"items": [{"type": "image_url", "image_url": {"url": "http://localhost/" + "a" * 100_000}}]}),
    ("data URI of another type", {"items": [{"type": "image_url", "image_url": {"url": "data:text/html;base64,PGI+"}}]}),
    ("image a number", {"items": [{"type": "image", "image": 12}]}),
    ("video a string", {"items": [{"type": "video", "video": "frame"}]}),
    ("video of numbers", {"items": [{"type": "video", "video": [1]}]}),
    ("null body", None),
]
RAW_BODIES = [
    ("not UTF-8", b"\xff\xfe\x00{"),
    ("UTF-16 JSON", '{"items": []}'.encode("utf-16")),
    ("NaN", b'{"items": [], "receive_count": NaN}'),
    ("empty", b""),
    ("a lone string", b'"items"'),
    ("base64 of an image, not JSON", base64.b64encode(PNG)),
]
PATHS = [
    ("GET", "/v1/requests/%00"),
    ("GET", "/v1/requests/%0d%0aX-Injected:%201"),
    ("GET", "/v1/requests/" + "a" * 20_000),
    ("GET", "/v1/requests/..%2f..%2fetc%2fpasswd"),
    ("GET", "/v1/requests/x?wait_s=nan"),
    ("GET", "/v1/requests/x?wait_s=1e400"),
    ("GET", "/v1/requests/x?wait_s=abc"),
    ("DELETE", "/v1/requests/%ff%fe"),
    ("PUT", "/v1/encode"),
    ("GET", "/v1/encode"),
    ("POST", "/v1/nothing-here"),
    ("GET", "/v1/requests/x/items"),
    ("GET", "/v1/requests/x/items?rank=abc"),
    ("GET", "/v1/requests/x/items?rank=1e400&timeout_s=0"),
    ("GET", "/v1/requests/x/items?rank=-1&timeout_s=0"),
    ("GET", "/v1/requests/x/items?rank=0&timeout_s=nan"),
    ("GET", "/v1/requests/x/items?rank=0&timeout_s=-1"),
    ("GET", "/v1/requests?limit=abc"),
    ("GET", "/v1/requests?state=%00"),
    ("GET", "/v1/requests?cursor=" + "QUFB" * 5_000),
    ("GET", "/v1/requests?cursor=%ff%fe"),
]
DECODER_BODIES = [
    ("push", b"[" * 100_000),
    ("push", b"\xff\xfe\x00{"),
    ("push", b'{"rank": "0", "endpoint": "tcp://127.0.0.1:5555"}'),
    ("push", b'{"rank": 0, "endpoint": ["tcp://127.0.0.1:5555"]}'),
    ("push", b'{"rank": 0, "endpoint": "tcp://127.0.0.1:5555", "timeout_s": NaN}'),
    ("push", b'{"rank": 0, "endpoint": "tcp://127.0.0.1:5555", "extra": 1}'),
    ("push", b'{"rank": 0, "endpoint": "tcp://127.0.0.1:5555\\u0000"}'),
    ("push", b'{"rank": 0, "endpoint": "tcp://[::ffff:169.254.169.254]:80"}'),
    ("push", b'{"rank": 0, "endpoint": "' + b"a" * 100_000 + b'"}'),
    ("acknowledge", b'{"rank": -1}'),
    ("acknowledge", b'{"rank": 0, "transport": "ray"}'),
    ("acknowledge", b'{"rank": 0, "timeout_s": 1e400}'),
    ("acknowledge", b"null"),
    ("acknowledge", b"x" * 100_000),
]


def assert_client_error(response):
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code not in (404, 405) or response.headers.get("content-type", "").startswith("application/json"):
        body = response.json()
        assert set(body) == {"error"} or "detail" in body, body
        if "error" in body:
            assert body["error"]["code"] and body["error"]["message"]


@pytest.mark.parametrize("raw", [raw for _, raw in NESTED], ids=[name for name, _ in NESTED])
def test_deeply_nested_bodies_are_refused(cluster, raw):
    response = cluster.http.post("/v1/encode", content=raw, headers={"content-type": "application/json"})
    assert_client_error(response)
    assert response.json()["error"]["code"] == "invalid_request"


@pytest.mark.parametrize("body", [body for _, body in WRONG_TYPES], ids=[name for name, _ in WRONG_TYPES])
def test_wrong_types_and_odd_values_in_every_field_are_refused(cluster, body):
    response = cluster.http.post("/v1/encode", json=body)
    assert_client_error(response)
    assert response.json()["error"]["code"] == "invalid_request"


@pytest.mark.parametrize("raw", [raw for _, raw in RAW_BODIES], ids=[name for name, _ in RAW_BODIES])
def test_bodies_that_are_not_json_objects_are_refused(cluster, raw):
    response = cluster.http.post("/v1/encode", content=raw, headers={"content-type": "application/json"})
    assert_client_error(response)
    assert response.json()["error"]["code"] == "invalid_request"


@pytest.mark.parametrize("method,path", PATHS)
def test_odd_paths_and_queries_get_a_client_error(cluster, method, path):
    assert_client_error(cluster.http.request(method, path))


def test_odd_headers_get_a_client_error(cluster):
    for headers in (
        {"content-type": "text/plain"},
        {"authorization": "Bearer " + "x" * 10_000},
        {"authorization": "Basic Zm9vOmJhcg=="},
    ):
        merged = {**cluster.headers, **headers}
        response = cluster.http.post("/v1/encode", content=b'{"items": []}', headers=merged)
        assert_client_error(response)


@pytest.mark.parametrize("action,raw", DECODER_BODIES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(DECODER_BODIES)])
def test_odd_bodies_on_the_decoder_routes_are_refused(cluster, action, raw):
    response = cluster.http.post(f"/v1/requests/x/{action}", content=raw, headers={"content-type": "application/json"})
    assert_client_error(response)
    assert response.json()["error"]["code"] in ("invalid_request", "invalid_rank", "payload_too_large")
