"""``image_ref`` items: a Python handle caller's image bytes, already in the object store, are
hashed by the Ingress and passed on as that same ref (one copy in the store), with every bad
ref refused as invalid_request before anything is staged."""

import hashlib
import time

import pytest
import ray
from ray import serve

from encoder import MediaError, media_digest
from registry.errors import InvalidRequest
from registry.inputs import INLINE_MAX_BYTES, ref_input
from support import MODEL_SPEC, image_bytes, image_item, reference_embedding, registry_stats


def _sha(data: bytes) -> str:
    return hashlib.sha256(reference_embedding(data, **MODEL_SPEC).tobytes()).hexdigest()


def _encode(items: list[dict]) -> dict:
    return serve.get_app_handle("epd").encode.remote({"receive_count": 1, "items": items}).result()


def test_a_handle_caller_passes_image_bytes_by_ref(cluster):
    small, large = image_bytes(48, 48, seed=7300), image_bytes(224, 224, seed=7301)
    assert len(small) <= INLINE_MAX_BYTES < len(large)
    refs = [ray.put(small), ray.put(large)]
    # With a base64 item beside them: all three kinds of input in one request.
    third = image_bytes(40, 40, seed=7302)
    out = _encode([{"type": "image_ref", "image_ref": ref} for ref in refs] + [image_item(third)])
    assert out["state"] == "staged" and len(out["items"]) == 3
    got = ray.get(cluster.ranks[0].fetch.remote(out["req_id"], digests=True))
    assert got["bytes"] == [_sha(d) for d in (small, large, third)]


def test_a_large_ref_is_passed_on_and_a_small_one_read_inline(cluster):
    small, large = image_bytes(48, 48, seed=7310), image_bytes(224, 224, seed=7311)
    large_ref, small_ref = ray.put(large), ray.put(small)
    stored = ref_input(large_ref, 1 << 24, 5.0)
    assert stored.ref == large_ref and stored.data is None and stored.digest == media_digest(large)
    inline = ref_input(small_ref, 1 << 24, 5.0)
    assert inline.ref is None and inline.data == small and inline.digest == media_digest(small)


def test_ref_input_refuses_what_is_not_readable_image_bytes_in_time(cluster):
    with pytest.raises(MediaError, match="the limit is 10 bytes"):
        ref_input(ray.put(b"x" * 11), 10, 5.0)
    # Far over the limit: refused from its size, never read into this process.
    with pytest.raises(MediaError, match=r"holds \d+ bytes; the limit is 4096 bytes \(it was not read\)"):
        ref_input(ray.put(b"x" * (1 << 20)), 4096, 5.0)

    @ray.remote(num_cpus=0)
    def slow() -> bytes:
        time.sleep(3)
        return b"late"

    started = time.monotonic()
    with pytest.raises(MediaError, match="not readable within 0.2 s"):
        ref_input(slow.remote(), 1 << 20, 0.2)
    assert time.monotonic() - started < 2.5


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ray.put({"not": "bytes"}), "must hold the image file's bytes, got dict"),
        (lambda: ray.put(b""), "the image is empty"),
        (lambda: ray.put(b"not an image"), "items[0]"),
        (lambda: "a string", "must be a ray.ObjectRef of the image bytes, got str"),
    ],
    ids=["not-bytes", "empty", "not-an-image", "not-a-ref"],
)
def test_bad_image_refs_are_refused_and_stage_nothing(cluster, make, message):
    before = registry_stats()
    with pytest.raises(InvalidRequest) as info:
        _encode([{"type": "image_ref", "image_ref": make()}])
    assert info.value.code == "invalid_request" and message in info.value.message
    after = registry_stats()
    assert (after["pending"], after["staged"]) == (0, 0)
    assert after["encoder_calls_total"] - before["encoder_calls_total"] <= 1  # only the undecodable one runs


def test_http_refuses_image_ref_items(cluster):
    out = cluster.http.post("/v1/encode", json={"items": [{"type": "image_ref", "image_ref": "0" * 56}]})
    assert out.status_code == 422 and out.json()["error"]["code"] == "invalid_request"
    assert "'image_url', 'image', 'video'" in out.json()["error"]["message"]
