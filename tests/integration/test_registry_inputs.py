"""How media reaches the registry: ``MediaInput`` (digest + inline bytes or one stored copy)."""

import pytest
import ray

from encoder import media_digest
from registry import MediaInput, lookup_registry, media_input
from registry.errors import InvalidRequest, Unavailable, UnknownRequest
from registry.server.inputs import INLINE_MAX_BYTES
from support import MODEL_SPEC, image_bytes, reference_embedding, registry_stats, wait_until


@ray.remote(num_cpus=0)
class _Holder:
    """Stores media from another process, so the test can kill the bytes' owner."""

    def make(self, data: bytes) -> list[MediaInput]:
        return [media_input(data)]  # in a list: the ref stays owned here, the caller borrows it


def _lost(ref) -> bool:
    try:
        ray.get(ref, timeout=5)
    except ray.exceptions.ObjectLostError:
        return True
    return False


def test_small_items_travel_inline_and_large_ones_are_stored_once(cluster):
    small, large = image_bytes(32, 32, seed=201), image_bytes(224, 224, seed=202)
    assert len(small) <= INLINE_MAX_BYTES < len(large)
    inline, stored = media_input(small), media_input(large)
    assert (inline.data, inline.ref) == (small, None)
    assert stored.data is None and ray.get(stored.ref) == large
    assert (inline.digest, stored.digest) == (media_digest(small), media_digest(large))

    registry = lookup_registry(req_id="inputs-1")
    out = ray.get(registry.submit.remote("inputs-1", [inline, stored], "inputs-1", 1, True))
    assert out["state"] == "staged"
    got = ray.get(cluster.ranks[0].fetch.remote("inputs-1"))
    assert got["bytes"] == [reference_embedding(d, **MODEL_SPEC).tobytes() for d in (small, large)]


@pytest.mark.parametrize("items", [[b"raw bytes"], "not a list", [None]])
def test_submit_takes_media_inputs_only(cluster, items):
    with pytest.raises(InvalidRequest) as info:
        ray.get(lookup_registry(req_id="inputs-bad").submit.remote("inputs-bad", items, "d", 1, True))
    assert info.value.code == "invalid_request" and "media_input" in info.value.message
    with pytest.raises(UnknownRequest):  # nothing was created for it
        ray.get(lookup_registry(req_id="inputs-bad").describe.remote("inputs-bad"))


def test_input_lost_with_its_owner_fails_unavailable_and_stages_nothing(cluster):
    holder = _Holder.remote()
    [item] = ray.get(holder.make.remote(image_bytes(224, 224, seed=203)))
    assert item.ref is not None
    ray.kill(holder)  # the bytes' owner dies before the encoder read them
    wait_until(lambda: _lost(item.ref), 30, what="Ray to declare the input lost with its owner")
    before = registry_stats()
    with pytest.raises(Unavailable) as info:
        ray.get(lookup_registry(req_id="inputs-lost").submit.remote("inputs-lost", [item], "inputs-lost", 1, True), timeout=60)
    assert info.value.code == "unavailable"
    assert info.value.message.startswith("items[0]: the input bytes were lost") and "retry" in info.value.message
    after = registry_stats()
    assert after["staged"] == before["staged"] and after["failed_total"] == before["failed_total"] + 1


def test_stored_input_outlives_its_callers_reference_while_the_registry_encodes(cluster):
    # wait=false: the Ingress answers "pending" and drops its refs at once; the registry's
    # borrowed ref must keep the bytes until the encoder has read them.
    data = image_bytes(224, 224, seed=204)
    item = media_input(data)
    assert item.ref is not None
    out = ray.get(lookup_registry(req_id="inputs-nowait").submit.remote("inputs-nowait", [item], "inputs-nowait", 1, False))
    del item
    assert out["state"] in ("pending", "staged")
    got = ray.get(cluster.ranks[0].fetch.remote("inputs-nowait"))
    assert got["bytes"] == [reference_embedding(data, **MODEL_SPEC).tobytes()]
