"""Every wait and every byte is bounded: a wait on a req_id the service has never seen ends at
once (404 ``unknown_request``) unless the caller asks to wait for a submit; waiting requests
are capped per Ingress replica (``max_waiting_requests``), so ``/health`` always answers; an
Ingress-to-registry call has a deadline; the media of pending requests counts against
``max_pending_input_bytes``."""

import asyncio
import time
import uuid

import httpx
import pytest
import ray

from engine_support import Gate, gated
from registry import lookup_registry, media_input
from support import deployment_options, image_bytes, image_item, own_app, registry_stats, wait_until


def _burst(cluster, paths: list[str], timeout_s: float) -> list[httpx.Response]:
    """GET every path at once (one connection each), all within ``timeout_s``."""

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=len(paths), max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=cluster.url, headers=cluster.headers, limits=limits, timeout=120) as http:
            return await asyncio.wait_for(asyncio.gather(*(http.get(path) for path in paths)), timeout_s)

    return asyncio.run(run())


def _health_within(cluster, seconds: float) -> list[float]:
    took = []
    for _ in range(3):
        started = time.monotonic()
        assert httpx.get(f"{cluster.url}/health", timeout=seconds).status_code == 200
        took.append(time.monotonic() - started)
    return took


@pytest.mark.slow
def test_a_thousand_waits_on_unknown_req_ids_end_at_once_and_health_answers_within_a_second(cluster):
    paths = [f"/v1/requests/never-{uuid.uuid4().hex[:12]}?wait_s=60" for _ in range(1000)]
    answers = _burst(cluster, paths, timeout_s=45)  # each would otherwise hold a slot for 60 s
    codes = [(a.status_code, a.json()["error"]["code"]) for a in answers]
    # Unknown: answered at once. The ones that found max_waiting_requests in the registry
    # call already were refused at once too.
    assert set(codes) <= {(404, "unknown_request"), (429, "overloaded")} and (404, "unknown_request") in codes
    assert max(_health_within(cluster, 1.0)) < 1.0


@pytest.mark.slow
def test_waits_for_a_submit_past_max_waiting_requests_are_refused_at_once_while_health_answers(cluster):
    limit = 256  # the default max_waiting_requests, of the suite's one Ingress replica
    paths = [f"/v1/requests/later-{uuid.uuid4().hex[:12]}?wait_s=30&wait_for_submit=true" for _ in range(limit + 100)]

    async def run():
        limits = httpx.Limits(max_connections=len(paths), max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=cluster.url, headers=cluster.headers, limits=limits, timeout=120) as http:
            waits = [asyncio.ensure_future(http.get(path)) for path in paths]
            # Every request is in once the ones past the limit have been refused (at once); the
            # others wait for their submit, each holding a request slot of the replica.
            deadline = time.monotonic() + 60
            while sum(w.done() for w in waits) < 100 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            waiting = sum(not w.done() for w in waits)
            started = time.monotonic()
            health = await http.get("/health", timeout=5)
            took = time.monotonic() - started
            return await asyncio.gather(*waits), health, took, waiting

    answers, health, took, waiting = asyncio.run(run())
    assert waiting == limit and health.status_code == 200 and took < 1.0, (waiting, took)
    codes = [(a.status_code, a.json()["error"]["code"]) for a in answers]
    assert codes.count((429, "overloaded")) >= 100 and set(codes) == {(429, "overloaded"), (404, "unknown_request")}
    refused = next(a for a in answers if a.status_code == 429)
    assert "max_waiting_requests=256" in refused.json()["error"]["message"] and refused.headers["retry-after"] == "1"


def test_a_wait_for_a_submit_gets_the_entry_once_it_is_submitted(cluster):
    req_id = f"later-{uuid.uuid4().hex[:12]}"
    unknown = cluster.http.get(f"/v1/requests/{req_id}", params={"wait_s": 30})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_request"
    pull = cluster.http.get(f"/v1/requests/{req_id}/items", params={"rank": 0, "timeout_s": 30})
    assert pull.status_code == 404 and pull.json()["error"]["code"] == "unknown_request"

    async def wait_then_submit():
        async with httpx.AsyncClient(base_url=cluster.url, headers=cluster.headers, timeout=60) as http:
            waiting = asyncio.ensure_future(http.get(f"/v1/requests/{req_id}",
                                                     params={"wait_s": 30, "wait_for_submit": "true"}))
            await asyncio.sleep(1.0)
            assert not waiting.done()
            body = {"req_id": req_id, "receive_count": 1, "items": [image_item(image_bytes(40, 40, seed=95))]}
            assert (await http.post("/v1/encode", json=body)).status_code == 200
            return await waiting

    described = asyncio.run(wait_then_submit())
    assert described.status_code == 200 and described.json()["state"] == "staged", described.text
    assert cluster.http.delete(f"/v1/requests/{req_id}").json()["state"] == "cancelled"


def test_the_media_of_pending_requests_counts_until_their_encode_ends(cluster):
    data = image_bytes(128, 128, seed=96)
    gate, req_id = Gate.remote(), f"held-{uuid.uuid4().hex[:12]}"
    held = media_input(data)
    item = type(held)(held.digest, ref=gated.remote(gate, data), nbytes=len(data))  # the encoder waits for the gate
    registry = lookup_registry(req_id=req_id)
    before = registry_stats()["pending_input_bytes"]
    assert ray.get(registry.submit.remote(req_id, [item], held.digest, 1, False))["state"] == "pending"
    assert registry_stats()["pending_input_bytes"] == before + len(data)
    ray.get(gate.open.remote())
    wait_until(lambda: cluster.http.get(f"/v1/requests/{req_id}").json()["state"] == "staged", 30, what="the entry staged")
    assert registry_stats()["pending_input_bytes"] == before
    cluster.http.delete(f"/v1/requests/{req_id}")
    ray.kill(gate)


@pytest.fixture
def quick_deadline_app(cluster):
    with own_app({**cluster.app_args, "registry_call_timeout_s": 2.0}, deployment_options(), "deadline") as app:
        yield app


@pytest.mark.slow
def test_a_registry_that_does_not_answer_gets_its_callers_a_503_within_the_deadline(cluster, quick_deadline_app):
    prefix = quick_deadline_app.prefix
    assert cluster.http.get(f"{prefix}/v1/stats").status_code == 200
    shard = lookup_registry(*quick_deadline_app.registry)
    stuck = shard.__ray_call__.remote(lambda self: time.sleep(8))  # blocks the registry's event loop
    time.sleep(0.5)
    started = time.monotonic()
    answer = cluster.http.get(f"{prefix}/v1/stats")
    took = time.monotonic() - started
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "unavailable", answer.text
    assert 2.0 <= took < 6.0, took
    ray.get(stuck)
    assert cluster.http.get(f"{prefix}/v1/stats").status_code == 200
