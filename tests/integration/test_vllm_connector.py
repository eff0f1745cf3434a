"""vLLM 0.33's real V1 scheduler and worker plumbing load what the running service staged,
through RayRegistryECConnector (built by vLLM's own factory from an ec_transfer_config).

The scheduler runs in this process against the shared cluster's registry; each TP rank's
worker-role connector runs in its own Ray actor. Item identifiers are one-item encodes'
req_ids, with receive_count = the TP size (2). The served model is the suite's tiny-vit
(128x128 pixels -> 64 tokens); the engine's requests use Qwen2.5-VL grids of the same token
count, (1, 16, 16).
"""

import pickle
import threading
import time
import uuid

import pytest
import ray

import vllm_env
from engine_support import Gate, SilentRegistry, StuckRegistry, VllmWorkerRank, gated
from registry import lookup_registry, media_input
from support import MODEL_SPEC, image_bytes, image_item, reference_embedding

TP = 2
GRID = (1, 16, 16)  # 64 placeholder tokens
SIZE = 128  # tiny-vit: (128/16)^2 = 64 tokens


def new_id(prefix="vi"):
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def engine(cluster, tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("qwen-for-vllm"))
    vllm_env.save_tiny_qwen_for_vllm(model_dir)
    cfg = vllm_env.make_vllm_config(
        model_dir, ec_connector="RayRegistryECConnector", module_path="registry.vllm_connector",
        extra_config={"registry_name": "epd_registry", "registry_namespace": "epd", "watch_timeout_s": 2.0},
        tensor_parallel_size=TP,
    )
    ranks = []
    for rank in range(TP):
        rank_cfg = pickle.loads(pickle.dumps(cfg))
        rank_cfg.ec_transfer_config.ec_connector_extra_config["tp_rank"] = rank
        ranks.append(VllmWorkerRank.remote(pickle.dumps(rank_cfg)))
    ray.get([r.__ray_ready__.remote() for r in ranks])
    yield cfg, ranks
    for rank in ranks:
        ray.kill(rank)


@pytest.fixture(autouse=True)
def encoder_caches_freed(engine):
    """After each test the ranks' encoder caches are freed, as the engine frees them."""
    yield
    ray.get([rank.clear.remote() for rank in engine[1]])


@pytest.fixture
def scheduler(engine):
    cfg, _ = engine
    return vllm_env.make_scheduler(cfg)


def encode(cluster, data, req_id, wait=True, receive_count=TP):
    body = {"req_id": req_id, "receive_count": receive_count, "items": [image_item(data)], "wait": wait}
    response = cluster.http.post("/v1/encode", json=body)
    assert response.status_code in (200, 202), response.text
    return response.json()


def state(cluster, req_id):
    return cluster.http.get(f"/v1/requests/{req_id}").json()


def step_until(scheduler, condition, what, timeout_s=30.0, **step_args):
    """Step the engine until ``condition(step_result)``; every step is returned, last one last."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = vllm_env.step(scheduler, **step_args)
        step_args = {}
        seen.append(result)
        if condition(result):
            return seen
        time.sleep(0.01)
    raise AssertionError(f"no step within {timeout_s}s where {what}")


def loads_of(result):
    meta = result.scheduler_output.ec_connector_metadata
    return {load.identifier: load.num_tokens for load in meta.loads}


def load_on_ranks(ranks, result):
    blob = pickle.dumps(result.scheduler_output)
    return ray.get([rank.load.remote(blob) for rank in ranks])


def aggregated(loaded):
    return vllm_env.aggregate_ec_outputs([pickle.loads(r["output"]) for r in loaded])


def test_staged_items_load_from_the_registry_and_never_encoded_ones_are_computed_locally(cluster, engine, scheduler):
    _, ranks = engine
    staged, never = new_id(), new_id("never")
    data = image_bytes(SIZE, SIZE, seed=601)
    encode(cluster, data, staged)
    scheduler.add_request(vllm_env.image_request("chat-1", [staged, never], grid_thw=[GRID, GRID]))

    steps = step_until(scheduler, lambda r: "chat-1" in r.scheduler_output.num_scheduled_tokens, "chat-1 is scheduled")
    first = steps[-1]
    assert loads_of(first) == {staged: 64}  # loaded externally, with its token count
    assert first.scheduler_output.scheduled_encoder_inputs["chat-1"] == [1]  # only the unknown item runs locally

    # TP=2: each rank fetches as its own rank; the entry is released after the second.
    rank0 = ray.get(ranks[0].load.remote(pickle.dumps(first.scheduler_output)))
    assert state(cluster, staged)["received_ranks"] == [0] and state(cluster, staged)["state"] == "staged"
    rank1 = ray.get(ranks[1].load.remote(pickle.dumps(first.scheduler_output)))
    assert state(cluster, staged)["state"] == "released"
    expected = reference_embedding(data, **MODEL_SPEC)
    import hashlib

    for loaded in (rank0, rank1):
        item = loaded["cache"][staged]
        assert item["sha256"] == hashlib.sha256(expected.tobytes()).hexdigest()  # bitwise the encoder's output
        assert (item["dtype"], item["shape"], item["device"]) == ("bfloat16", [64, 512], "cpu")
    output = aggregated([rank0, rank1])
    assert output.ec_connector_worker_meta.loaded == {staged} and not output.ec_connector_worker_meta.failed
    steps = step_until(scheduler, lambda r: "chat-1" in r.finished, "chat-1 finishes", ec_connector_output=output)
    assert steps[-1].finished["chat-1"].name == "LENGTH"


def test_bytes_equal_what_an_embedding_receiver_gets(cluster, engine, scheduler):
    _, ranks = engine
    data = image_bytes(SIZE, SIZE, seed=602)
    for_engine, for_receiver = new_id(), new_id()
    encode(cluster, data, for_engine)
    encode(cluster, data, for_receiver, receive_count=2)
    received = ray.get([cluster.ranks[r].fetch.remote(for_receiver, digests=True) for r in range(2)])
    scheduler.add_request(vllm_env.image_request("chat-2", [for_engine], grid_thw=[GRID]))
    steps = step_until(scheduler, lambda r: loads_of(r), "the item is handed to the workers")
    loaded = load_on_ranks(ranks, steps[-1])
    assert [r["cache"][for_engine]["sha256"] for r in loaded] == [received[0]["bytes"][0], received[1]["bytes"][0]]
    assert state(cluster, for_engine)["state"] == "released"
    step_until(scheduler, lambda r: "chat-2" in r.finished, "chat-2 finishes", ec_connector_output=aggregated(loaded))


def test_a_pending_item_defers_its_request_until_it_is_staged(cluster, engine, scheduler):
    _, ranks = engine
    data = image_bytes(SIZE, SIZE, seed=603)
    gate, req_id = Gate.remote(), new_id("pending")
    held = media_input(data)
    item = type(held)(held.digest, ref=gated.remote(gate, data))  # the encoder waits for the gate
    registry = lookup_registry(req_id=req_id)
    submitted = ray.get(registry.submit.remote(req_id, [item], held.digest, TP, False))
    assert submitted["state"] == "pending"
    scheduler.add_request(vllm_env.image_request("chat-3", [req_id], grid_thw=[GRID]))
    connector = scheduler.get_ec_connector()
    # The engine keeps stepping and the request waits: until the registry's answer (pending)
    # arrives, and for 3 s more. Those steps have nothing to run: each waits for the registry's
    # next answer (up to 1.6 s) instead of returning at once, so there are a few, not hundreds.
    steps = step_until(scheduler, lambda r: connector.has_cache_item(req_id), "the registry says it is pending")
    idle_until, idle = time.monotonic() + 3.0, 0
    while time.monotonic() < idle_until:
        steps.append(vllm_env.step(scheduler))
        idle += 1
    assert 2 <= idle <= 12, idle
    assert all("chat-3" not in result.scheduler_output.num_scheduled_tokens for result in steps)
    assert not connector.has_cache_item(new_id("never"))
    assert connector.has_cache_item(req_id)  # pending counts: the service has it
    ray.get(gate.open.remote())
    steps = step_until(scheduler, lambda r: "chat-3" in r.scheduler_output.num_scheduled_tokens, "chat-3 is scheduled")
    assert loads_of(steps[-1]) == {req_id: 64}
    assert "chat-3" not in steps[-1].scheduler_output.scheduled_encoder_inputs
    loaded = load_on_ranks(ranks, steps[-1])
    assert state(cluster, req_id)["state"] == "released"
    step_until(scheduler, lambda r: "chat-3" in r.finished, "chat-3 finishes", ec_connector_output=aggregated(loaded))
    ray.kill(gate)


def test_ranks_that_already_had_the_items_cached_still_count(cluster, engine, scheduler):
    _, ranks = engine
    req_ids = [new_id("cached") for _ in range(4)]  # on several shards: one call to each per step
    for seed, req_id in enumerate(req_ids, start=604):
        encode(cluster, image_bytes(SIZE, SIZE, seed=seed), req_id)
    scheduler.add_request(vllm_env.image_request("chat-4", req_ids, grid_thw=[GRID] * len(req_ids)))
    steps = step_until(scheduler, lambda r: loads_of(r), "the items are handed to the workers")
    assert set(loads_of(steps[-1])) == set(req_ids)
    for req_id in req_ids:
        ray.get(ranks[1].prime.remote(req_id, 64, 512))
    loaded = load_on_ranks(ranks, steps[-1])
    for req_id in req_ids:
        assert loaded[1]["cache"][req_id]["sha256"] != loaded[0]["cache"][req_id]["sha256"]  # rank 1 kept its own copy
        described = state(cluster, req_id)
        assert described["state"] == "released" and described["received_ranks"] == [0, 1]  # not left to its ttl
    step_until(scheduler, lambda r: "chat-4" in r.finished, "chat-4 finishes", ec_connector_output=aggregated(loaded))
    # What the scheduler side remembered per item went with the request.
    side = scheduler.get_ec_connector()._scheduler
    assert side.view.tracked() == 0 and side._num_tokens == {}


def _step_within(scheduler, seconds):
    """One engine step, which must return within ``seconds`` (it would hang on a registry call)."""
    done = []
    stepper = threading.Thread(target=lambda: done.append(vllm_env.step(scheduler)), daemon=True)
    stepper.start()
    stepper.join(seconds)
    assert done, f"an engine step did not return within {seconds}s"
    return done[0]


def test_a_registry_that_does_not_answer_never_holds_up_a_step(cluster, engine):
    cfg, _ = engine
    gate, name = Gate.remote(), new_id("silent")
    silent = SilentRegistry.options(name=name, namespace="epd").remote(gate)
    ray.get(silent.__ray_ready__.remote())
    own = pickle.loads(pickle.dumps(cfg))
    own.ec_transfer_config.ec_connector_extra_config["registry_name"] = name
    scheduler = vllm_env.make_scheduler(own)
    try:
        scheduler.add_request(vllm_env.image_request("chat-11", [new_id("unheard")], grid_thw=[GRID]))
        # The lookup waits for the ping on a thread of its own; every step returns, and the
        # request waits for the registry's answer.
        for _ in range(5):
            result = _step_within(scheduler, 10)
            assert "chat-11" not in result.scheduler_output.num_scheduled_tokens
            time.sleep(0.05)
        ray.get(gate.open.remote())
        steps = step_until(scheduler, lambda r: "chat-11" in r.scheduler_output.num_scheduled_tokens, "chat-11 runs")
        # Found at last, the registry has never heard of the item: the engine computes it.
        assert steps[-1].scheduler_output.scheduled_encoder_inputs["chat-11"] == [0]
    finally:
        ray.kill(silent)
        ray.kill(gate)


def test_a_registry_that_takes_calls_and_never_answers_has_its_items_computed_by_the_engine(cluster, engine):
    """Alive, found, and silent: past registry_deadline_s (watch_timeout_s 2 s: 7 s) the
    scheduler stops waiting for it, and the engine encodes the items itself."""
    name = new_id("stuck")
    stuck = StuckRegistry.options(name=name, namespace="epd").remote()
    try:
        scheduler = _scheduler(engine[0], registry_name=name)
        scheduler.add_request(vllm_env.image_request("chat-12", [new_id("unanswered")], grid_thw=[GRID]))
        started = time.monotonic()
        steps = step_until(scheduler, lambda r: "chat-12" in r.scheduler_output.num_scheduled_tokens, "chat-12 runs")
        waited = time.monotonic() - started
        assert steps[-1].scheduler_output.scheduled_encoder_inputs["chat-12"] == [0]  # the engine encodes it
        assert 7.0 <= waited < 25.0, waited  # not before the deadline; and then at once, not at the next long poll
    finally:
        ray.kill(stuck)


def _scheduler(cfg, **extra):
    """A scheduler of its own, with ``extra`` in its ``ec_connector_extra_config``."""
    own = pickle.loads(pickle.dumps(cfg))
    own.ec_transfer_config.ec_connector_extra_config.update(extra)
    return vllm_env.make_scheduler(own)


@pytest.mark.parametrize("fallback", [True, False], ids=["computed-by-the-engine", "local_fallback-off"])
@pytest.mark.parametrize("ending", ["cancelled", "failed"])
def test_an_item_that_ends_badly_is_computed_by_the_engine_or_fails_its_request(cluster, engine, ending, fallback):
    scheduler = _scheduler(engine[0], local_fallback=fallback)
    req_id = new_id(ending)
    if ending == "cancelled":
        gate = Gate.remote()
        data = image_bytes(SIZE, SIZE, seed=605)
        held = media_input(data)
        item = type(held)(held.digest, ref=gated.remote(gate, data))
        ray.get(lookup_registry(req_id=req_id).submit.remote(req_id, [item], held.digest, TP, False))
    else:
        truncated = image_bytes(SIZE, SIZE, seed=606)[:300]  # decodes its header, not its pixels
        encode(cluster, truncated, req_id, wait=False)
    scheduler.add_request(vllm_env.image_request("chat-5", [req_id], grid_thw=[GRID]))
    vllm_env.step(scheduler)
    if ending == "cancelled":
        assert cluster.http.delete(f"/v1/requests/{req_id}").json()["state"] == "cancelled"
    if fallback:  # as without the service: the engine's own encoder runs it
        steps = step_until(scheduler, lambda r: "chat-5" in r.scheduler_output.num_scheduled_tokens, "chat-5 runs")
        assert steps[-1].scheduler_output.scheduled_encoder_inputs["chat-5"] == [0] and not loads_of(steps[-1])
        steps = step_until(scheduler, lambda r: "chat-5" in r.finished, "chat-5 finishes")
        assert steps[-1].finished["chat-5"].name == "LENGTH"
    else:
        steps = step_until(scheduler, lambda r: "chat-5" in r.finished, "chat-5 is failed")
        assert steps[-1].finished["chat-5"].name == "ERROR"
        assert all("chat-5" not in r.scheduler_output.num_scheduled_tokens for r in steps)  # never ran
    assert state(cluster, req_id)["state"] == ending
    if ending == "cancelled":
        ray.kill(gate)


def test_a_worker_side_load_error_fails_the_request_and_the_worker_survives(cluster, engine, scheduler):
    _, ranks = engine
    wrong = new_id("wrong")
    # Staged with 64 tokens, but the engine's request has room for 16: another model's embedding.
    encode(cluster, image_bytes(SIZE, SIZE, seed=607), wrong)
    scheduler.add_request(vllm_env.image_request("chat-6", [wrong], grid_thw=[(1, 8, 8)]))
    steps = step_until(scheduler, lambda r: loads_of(r), "the item is handed to the workers")
    loaded = load_on_ranks(ranks, steps[-1])
    for result in loaded:
        placeholder = result["cache"][wrong]
        assert placeholder["shape"][0] == 16 and placeholder["all_zero"]  # the step can run; nothing crashed
    output = aggregated(loaded)
    assert set(output.ec_connector_worker_meta.failed) == {wrong}
    steps = step_until(scheduler, lambda r: "chat-6" in r.finished, "chat-6 is failed", ec_connector_output=output)
    assert steps[-1].finished["chat-6"].name == "ERROR"
    assert state(cluster, wrong)["state"] == "released"  # both ranks fetched it: nothing left behind

    # The same workers go on loading.
    good = new_id("good")
    encode(cluster, image_bytes(SIZE, SIZE, seed=608), good)
    scheduler.add_request(vllm_env.image_request("chat-7", [good], grid_thw=[GRID]))
    steps = step_until(scheduler, lambda r: loads_of(r), "the next item is handed to the workers")
    loaded = load_on_ranks(ranks, steps[-1])
    assert all(not r["cache"][good]["all_zero"] for r in loaded)
    assert state(cluster, good)["state"] == "released"
    step_until(scheduler, lambda r: "chat-7" in r.finished, "chat-7 finishes", ec_connector_output=aggregated(loaded))


def test_an_item_the_engine_had_cached_is_acknowledged_not_left_to_its_ttl(cluster, engine, scheduler):
    _, ranks = engine
    item = new_id("had")
    # The engine computes the item itself first (the registry has never heard of it) ...
    scheduler.add_request(vllm_env.image_request("chat-8", [item], grid_thw=[GRID], max_tokens=200))
    steps = step_until(scheduler, lambda r: "chat-8" in r.scheduler_output.num_scheduled_tokens, "chat-8 is scheduled")
    assert steps[-1].scheduler_output.scheduled_encoder_inputs["chat-8"] == [0]
    # ... then the service stages it for this engine, and a second request names it.
    encode(cluster, image_bytes(SIZE, SIZE, seed=609), item)
    scheduler.add_request(vllm_env.image_request("chat-9", [item], grid_thw=[GRID], max_tokens=2))
    steps = step_until(scheduler, lambda r: "chat-9" in r.scheduler_output.num_scheduled_tokens, "chat-9 is scheduled")
    meta = steps[-1].scheduler_output.ec_connector_metadata
    assert [(load.identifier, load.acknowledge_only) for load in meta.loads] == [(item, True)]
    assert "chat-9" not in steps[-1].scheduler_output.scheduled_encoder_inputs  # served from the engine's cache
    loaded = load_on_ranks(ranks, steps[-1])
    assert all(item not in r["cache"] for r in loaded)  # no bytes read
    described = state(cluster, item)
    assert described["state"] == "released" and described["received_ranks"] == [0, 1]
    from vllm.v1.request import RequestStatus

    scheduler.finish_requests("chat-8", RequestStatus.FINISHED_ABORTED)
    step_until(scheduler, lambda r: "chat-9" in r.finished, "chat-9 finishes")


def test_without_fallback_an_item_that_expires_while_its_request_waits_fails_the_request(cluster, engine):
    from registry import get_or_create_registry
    from support import registry_settings

    cfg, _ = engine
    # A registry of its own with a 1 s ttl, encoding through the same Encoder deployment.
    settings = registry_settings(f"short-ttl-{uuid.uuid4().hex[:6]}", "epd", ttl_s=1.0)
    registry = get_or_create_registry(settings)
    scheduler = _scheduler(cfg, registry_name=settings.name, local_fallback=False)
    gate = Gate.remote()
    try:
        staged, pending = new_id("expiring"), new_id("held")
        data = image_bytes(SIZE, SIZE, seed=610)
        item = media_input(data)
        assert ray.get(registry.submit.remote(staged, [item], item.digest, TP, True))["state"] == "staged"
        other = image_bytes(SIZE, SIZE, seed=611)
        held = media_input(other)
        gated_item = type(held)(held.digest, ref=gated.remote(gate, other))
        ray.get(registry.submit.remote(pending, [gated_item], held.digest, TP, False))
        # The request waits for its pending item while the staged one's ttl runs out.
        scheduler.add_request(vllm_env.image_request("chat-10", [staged, pending], grid_thw=[GRID, GRID]))
        steps = step_until(scheduler, lambda r: "chat-10" in r.finished, "chat-10 is failed")
        assert steps[-1].finished["chat-10"].name == "ERROR"
        assert all("chat-10" not in r.scheduler_output.num_scheduled_tokens for r in steps)
        assert ray.get(registry.states.remote([staged]))[staged] == "expired"
    finally:
        ray.kill(registry)
        ray.kill(gate)
