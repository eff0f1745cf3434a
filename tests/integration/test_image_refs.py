"""``image_ref`` items: a Python handle caller's image bytes, already in the object store, are
hashed by the Ingress and passed on as that same ref (one copy in the store), with every bad
ref refused as invalid_request before anything is staged."""

import hashlib
import re
import time

import pytest
import ray
from ray import serve

from encoder import MediaError, media_digest
from registry.errors import InvalidRequest
from registry.server.inputs import INLINE_MAX_BYTES, ref_input
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


@ray.remote(num_cpus=0)
class _OnALoop:
    """Runs ``ref_input`` where the Ingress runs it: on an async actor's event loop."""

    async def ref_input(self, boxed_ref: list, max_bytes: int, timeout_s: float) -> dict:
        from ray._private import worker

        ref = boxed_ref[0]  # in a list, so Ray hands the ref over instead of its value
        try:
            got = await ref_input(ref, max_bytes, timeout_s)
            out = {"digest": got.digest, "data": got.data, "passed_on": got.ref == ref}
        except MediaError as exc:
            out = {"error": str(exc)}
        # Ray sets this (and warns) when a blocking ray.get runs in an async actor.
        return {**out, "blocked_its_loop": worker.blocking_get_inside_async_warned}


@pytest.fixture(scope="module")
def on_a_loop(cluster):
    actor = _OnALoop.remote()
    yield lambda ref, max_bytes, timeout_s: ray.get(actor.ref_input.remote([ref], max_bytes, timeout_s))
    ray.kill(actor)


def test_a_large_ref_is_passed_on_and_a_small_one_read_inline(cluster, on_a_loop):
    small, large = image_bytes(48, 48, seed=7310), image_bytes(224, 224, seed=7311)
    stored = on_a_loop(ray.put(large), 1 << 24, 5.0)
    assert stored == {"digest": media_digest(large), "data": None, "passed_on": True, "blocked_its_loop": False}
    inline = on_a_loop(ray.put(small), 1 << 24, 5.0)
    assert inline == {"digest": media_digest(small), "data": small, "passed_on": False, "blocked_its_loop": False}


def test_ref_input_refuses_what_is_not_readable_image_bytes_in_time(cluster, on_a_loop):
    assert "the limit is 10 bytes" in on_a_loop(ray.put(b"x" * 11), 10, 5.0)["error"]
    # Far over the limit: refused from its size, never read into this process.
    refused = on_a_loop(ray.put(b"x" * (1 << 20)), 4096, 5.0)["error"]
    assert re.fullmatch(r"the image_ref holds \d+ bytes; the limit is 4096 bytes \(it was not read\)", refused)

    @ray.remote(num_cpus=0)
    def slow() -> bytes:
        time.sleep(3)
        return b"late"

    started = time.monotonic()
    late = on_a_loop(slow.remote(), 1 << 20, 0.2)
    assert "not readable within 0.2 s" in late["error"] and not late["blocked_its_loop"]
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
