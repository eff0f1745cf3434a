"""Logs an operator can follow: one line per failed request naming its req_id, code and
cause, in the logs of the deployed components, and no traceback for a client's mistake."""

import json
import re
import uuid

import httpx
import pytest
import ray
from ray import serve

from deployments import compose_app
from support import APP_ARGS, deployment_options, image_bytes, image_item, log_lines_since, log_offsets, own_app, wait_until


def lines_naming(req_id, offsets):
    return {path: [line for line in lines if req_id in line] for path, lines in log_lines_since(offsets).items()
            if any(req_id in line for line in lines)}


def records(found):
    """The distinct log records in ``found``: a replica's line is in its Serve log file and,
    through its stderr, in its Ray worker log too."""
    return sorted({line.split(" -- ", 1)[-1] for lines in found.values() for line in lines})


def test_a_corrupt_image_leaves_one_line_with_req_id_code_and_cause_and_no_traceback(cluster):
    offsets = log_offsets()
    req_id = f"corrupt-{uuid.uuid4().hex[:8]}"
    truncated = image_bytes(64, 64, seed=51)[:300]
    response = cluster.http.post("/v1/encode", json={"req_id": req_id, "items": [image_item(truncated)]})
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request"

    found = wait_until(lambda: lines_naming(req_id, offsets), 20, what=f"a log line naming {req_id}")
    assert len(records(found)) == 1, found
    line = next(iter(found.values()))[0]
    assert "code=invalid_request" in line and "corrupt or truncated" in line and line.startswith("INFO")
    # Neither the Encoder replica (where decoding failed) nor anyone else wrote a traceback.
    added = log_lines_since(offsets)
    tracebacks = {path: [l for l in lines if "Traceback" in l or "Request failed" in l] for path, lines in added.items()}
    assert not any(tracebacks.values()), tracebacks


def test_a_refusal_by_the_ingress_itself_is_logged_there_once(cluster):
    offsets = log_offsets()
    req_id = f"many-{uuid.uuid4().hex[:8]}"
    body = {"req_id": req_id, "items": [image_item(image_bytes(32, 32, seed=52))] * 17}
    assert cluster.http.post("/v1/encode", json=body).status_code == 422
    found = wait_until(lambda: lines_naming(req_id, offsets), 20, what=f"a log line naming {req_id}")
    (record,) = records(found)
    assert "limit is 16" in record
    assert any("replica_epd_Ingress" in path for path in found)  # logged by the Ingress, which refused it


@pytest.mark.slow
def test_logging_config_json_debug_gives_json_lines_that_trace_a_req_id(cluster):
    from ray.serve.schema import LoggingConfig

    args = {**APP_ARGS, "api_token": cluster.app_args["api_token"]}
    logging = LoggingConfig(encoding="JSON", log_level="DEBUG")
    with own_app(args, deployment_options(), "json", ranks=1, logging_config=logging) as app:
        name, rank = app.name, app.ranks[0]
        offsets = log_offsets()
        # Refused by the Ingress: one JSON line in its Serve log.
        refused = f"json-{uuid.uuid4().hex[:8]}"
        body = {"req_id": refused, "items": [image_item(image_bytes(32, 32, seed=53))] * 17}
        assert cluster.http.post(f"/{name}/v1/encode", json=body).status_code == 422
        found = wait_until(lambda: lines_naming(refused, offsets), 20, what=f"a log line naming {refused}")
        serve_lines = [line for path, lines in found.items() if "/serve/" in path for line in lines]
        assert len(serve_lines) == 1, found
        record = json.loads(serve_lines[0])
        assert record["levelname"] == "INFO" and f"req_id={refused}" in record["message"]
        assert "code=invalid_request" in record["message"]

        # Served: the registry's DEBUG lines trace it, as JSON in its worker log.
        served = f"json-{uuid.uuid4().hex[:8]}"
        body = {"req_id": served, "receive_count": 1, "items": [image_item(image_bytes(32, 32, seed=55))]}
        assert cluster.http.post(f"/{name}/v1/encode", json=body).status_code == 200
        assert ray.get(rank.fetch.remote(served, timeout_s=30)).get("error") is None

        def registry_records():
            lines = [line[line.index("{"):] for path, lines in lines_naming(served, offsets).items()
                     if "/serve/" not in path for line in lines if '"levelname"' in line]
            messages = [json.loads(line)["message"] for line in lines]
            return messages if any("released" in m for m in messages) else None

        try:
            messages = wait_until(registry_records, 20)
        except AssertionError:
            raise AssertionError(f"no JSON line of the registry says {served} was released; "
                                 f"lines naming it: {lines_naming(served, offsets)}") from None
        for step in ("accepted: 1 items", "staged:", "rank 0 received it; released"):
            assert any(f"req_id={served} {step}" in m for m in messages), (step, messages)
        # And the replicas' DEBUG lines, JSON in their Serve log files: the Ingress received
        # it, the Encoder encoded its item.
        serve_records = [json.loads(line) for path, lines in lines_naming(served, offsets).items()
                         if "/serve/" in path for line in lines]
        by_deployment = {(r.get("deployment"), r["message"].split(": ", 1)[0]) for r in serve_records}
        assert (f"{name}_Ingress", f"req_id={served} received") in by_deployment, serve_records
        assert (f"{name}_Encoder", f"req_id={served} encoded") in by_deployment, serve_records


@pytest.mark.slow
def test_an_encode_failure_leaves_one_error_line_with_req_id_code_and_the_model_s_exception(cluster):
    # A misconfigured tower: it loads, and every forward pass raises (its position table is
    # built for a width divisible by 4, its patches are 130 wide).
    args = {**APP_ARGS, "api_token": cluster.app_args["api_token"],
            "model": {"family": "tiny-vit", "options": {"hidden_size": 130, "num_heads": 2}}}
    with own_app(args, deployment_options(), "broken") as app:
        name = app.name
        offsets = log_offsets()
        req_id = f"broken-{uuid.uuid4().hex[:8]}"
        response = cluster.http.post(f"/{name}/v1/encode", json={"req_id": req_id, "items": [image_item(image_bytes(32, 32, seed=54))]})
        assert response.status_code == 500 and response.json()["error"]["code"] == "encode_failed"
        assert "RuntimeError" not in response.text  # masked in the answer, named in the log

        found = wait_until(lambda: lines_naming(req_id, offsets), 20, what=f"a log line naming {req_id}")
        (record,) = records(found)
        assert all(line.startswith("ERROR") for lines in found.values() for line in lines), found
        # The model's exception itself, not Ray's wrapper of it.
        assert "code=encode_failed: items[0]: RuntimeError: The size of tensor a (130)" in record, record
        assert "RayTaskError" not in record


@pytest.mark.slow
def test_health_probes_while_the_encoder_starts_leave_one_not_ready_line_each_and_no_traceback(cluster):
    name = f"epd-starting-{uuid.uuid4().hex[:6]}"
    registry = {"registry_name": f"{name}-registry", "registry_namespace": "epd"}
    options = deployment_options()
    # Its replica waits for a resource no node has: the Encoder is "starting" for the whole test.
    options["Encoder"]["ray_actor_options"] = {"num_cpus": 0, "resources": {"never-on-this-cluster": 1}}
    # A replica that never started cannot answer Serve's graceful shutdown: without this, its
    # deletion would wait out Serve's 20 s for it.
    options["Encoder"]["graceful_shutdown_timeout_s"] = 1
    app = compose_app({**APP_ARGS, **registry}, deployment_options=options)
    serve.run_many([serve.RunTarget(app, name=name, route_prefix=f"/{name}")], wait_for_applications_running=False)
    try:
        offsets = log_offsets()
        # A patient probe is told why: 503 once the Ingress's own wait runs out.
        answer = cluster.http.get(f"/{name}/health", timeout=30)
        assert answer.status_code == 503 and answer.json()["status"] == "unavailable", answer.text
        # Impatient probes (a load balancer's 0.5 s) leave before any answer.
        for _ in range(3):
            with pytest.raises(httpx.ReadTimeout):
                cluster.http.get(f"/{name}/health", timeout=0.5)

        def not_ready_lines():
            lines = [line for lines in log_lines_since(offsets).values() for line in lines
                     if f"{name}_Ingress" in line and "/health: not ready" in line]
            distinct = set(lines)  # each line is in the replica's Serve log and in its stderr
            return distinct if len(distinct) >= 4 else None

        found = wait_until(not_ready_lines, 20, what="a 'not ready' line per probe")
        assert sum("not ready: waiting for the Encoder (no answer within 5 s)" in line for line in found) == 1, found
        # The Ingress sees the client leave a little after its 0.5 s, later on a loaded machine.
        left = re.compile(r"the probe left after \d+\.\d s, waiting for the Encoder")
        assert sum(bool(left.search(line)) for line in found) == 3, found
        assert all(line.startswith("INFO") for line in found), found
        added = log_lines_since(offsets)
        noisy = {path: [l for l in lines if "Traceback" in l or "never retrieved" in l] for path, lines in added.items()}
        assert not any(noisy.values()), noisy
    finally:
        serve.delete(name)
        ray.kill(ray.get_actor(registry["registry_name"], namespace="epd"))
