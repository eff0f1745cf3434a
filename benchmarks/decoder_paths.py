"""What each decoder path costs a rank: ``python -m benchmarks.decoder_paths``.

On a quiet local cluster with the stand-in app (the real ``Ingress`` and registry,
the stand-in encoder), a staged item of 0.26, 4.7 and 19 MB is received three ways,
interleaved round by round so every path sees the same machine:

* ``ray``: ``EmbeddingReceiver.fetch`` in a rank actor (registry call, zero-copy read);
* ``zmq``: ``ZmqEmbeddingReceiver.fetch`` in this process (push registration, the
  Ingress pushes the bytes, acknowledgement);
* ``http``: ``GET /v1/requests/{req_id}/items`` from this process, then
  ``safetensors.torch.load`` of the body.

Each is timed in the process that receives, to a usable tensor, beside its floor in
the same round: a no-op actor call from the rank actor, and one HTTP call through
Serve's proxy, the Ingress and the registry (``GET /v1/requests/{req_id}``) from this
process; a ZMQ fetch makes two HTTP calls (push, acknowledge). Also the CPU the
Ingress replica spends per MB on the ZMQ and HTTP paths (read from ``/proc`` around
each path's fetches), which the Ray path does not use at all. Prints one JSON object
of medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

import httpx
import ray
import safetensors.torch

from benchmarks import standin
from benchmarks.cpu import CpuMeter, by_title
from benchmarks.scale_out import QUIET_SIZES, BatchRank, Noop, submit_all, wait_staged
from registry import lookup_shards
from registry.client.zmq_receiver import ZmqEmbeddingReceiver

PATHS = ("ray", "zmq", "http")
# The floors: one no-op actor call (what the Ray path's registry call costs at least) and
# one HTTP call through Serve's proxy to the Ingress and the registry (``GET /v1/requests/{id}``).
BASELINES = ("actor_round_trip", "http_round_trip")


def _round(shards: Any, rank: Any, noop: Any, rx: ZmqEmbeddingReceiver, http: httpx.Client, nbytes: int) -> dict[str, float]:
    """One staged item per path; each path's seconds to a usable tensor, then the baselines."""
    req_ids = {path: uuid.uuid4().hex for path in PATHS}
    submit_all(shards, list(req_ids.values()), 1, 3, nbytes)
    wait_staged(shards, list(req_ids.values()))
    out = {"ray": ray.get(rank.fetch.remote(req_ids["ray"]))}
    start = time.perf_counter()
    rx.fetch(req_ids["zmq"], timeout_s=60.0)[0].tensor.numel()
    out["zmq"] = time.perf_counter() - start
    start = time.perf_counter()
    answer = http.get(f"/v1/requests/{req_ids['http']}/items", params={"rank": 0, "timeout_s": 60})
    answer.raise_for_status()
    safetensors.torch.load(answer.content)["item_0"].numel()
    out["http"] = time.perf_counter() - start
    out["actor_round_trip"] = ray.get(rank.round_trip.remote(noop))
    start = time.perf_counter()
    http.get(f"/v1/requests/{req_ids['http']}").raise_for_status()
    out["http_round_trip"] = time.perf_counter() - start
    return out


def _ingress_cpu_per_mb(shards: Any, rx: ZmqEmbeddingReceiver, http: httpx.Client, nbytes: int, count: int) -> dict[str, float]:
    """Ingress CPU ms per MB received over ZMQ and over HTTP (``count`` items each)."""
    classify = by_title({f"ServeReplica:{standin.APP}:Ingress": "ingress"})
    out = {}
    for path in ("zmq", "http"):
        req_ids = [uuid.uuid4().hex for _ in range(count)]
        submit_all(shards, req_ids, 1, 8, nbytes)
        wait_staged(shards, req_ids)
        with CpuMeter(classify) as cpu:
            for req_id in req_ids:
                if path == "zmq":
                    rx.fetch(req_id, timeout_s=60.0)
                else:
                    http.get(f"/v1/requests/{req_id}/items", params={"rank": 0}).raise_for_status()
        out[path] = cpu.by_role.get("ingress", 0.0) * 1e3 / (count * nbytes / 1e6)
    return out


def measure(http_url: str, registry_name: str, namespace: str, rounds: int, cpu_items: int) -> dict[str, Any]:
    shards = lookup_shards(registry_name, namespace)
    rank, noop = BatchRank.remote(0), Noop.remote()
    ray.get(rank.use_registry.remote(registry_name, namespace))
    out: dict[str, Any] = {}
    with ZmqEmbeddingReceiver(rank=0, url=f"{http_url}/{standin.APP}") as rx, httpx.Client(
        base_url=f"{http_url}/{standin.APP}", timeout=120
    ) as http:
        for nbytes in QUIET_SIZES:
            times: dict[str, list[float]] = {name: [] for name in (*PATHS, *BASELINES)}
            for r in range(rounds + 2):
                got = _round(shards, rank, noop, rx, http, nbytes)
                if r >= 2:  # two rounds warm every path up
                    for name, values in times.items():
                        values.append(got[name])
            p50 = {name: statistics.median(values) * 1e3 for name, values in times.items()}
            cpu = _ingress_cpu_per_mb(shards, rx, http, nbytes, cpu_items)
            out[f"{nbytes / 1e6:.2f}MB"] = {
                **{f"{name}_ms": round(value, 3) for name, value in p50.items()},
                **{f"{path}_vs_ray": round(p50[path] / p50["ray"], 2) for path in ("zmq", "http")},
                **{f"ingress_cpu_ms_per_mb_{path}": round(value, 3) for path, value in cpu.items()},
            }
    ray.kill(rank)
    ray.kill(noop)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds per size (default 20)")
    parser.add_argument("--cpu-items", type=int, default=20, help="items per path for the Ingress CPU (default 20)")
    args = parser.parse_args()
    with standin.served_alone("paths", QUIET_SIZES) as served:
        sizes = measure(served["http_url"], served["registry_name"], served["namespace"], args.rounds, args.cpu_items)
    report = {"sizes": sizes, "settings": vars(args)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
