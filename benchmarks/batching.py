"""Batched calls against one call each, side by side: ``python -m benchmarks.batching``.

Two stand-in apps on one quiet local cluster (``benchmarks.standin``: the real
Ingress and registry, the stand-in encoder), identical but for the two keys that
batch the encode path:

* ``batched``: the defaults, ``encoder_call_max_items`` 8 (items that reach the
  registry together share one Encoder call) and ``registry_call_max_requests`` 64
  (``wait: false`` requests that reach an Ingress replica together share one registry
  call);
* ``single``: both 1, one Encoder call per item and one registry call per request.

Rounds alternate between the two, so both see the same machine. Each round runs
lifecycles (an encode with ``wait: false`` + 4 rank fetches, as in
``benchmarks.service_cpu``) over HTTP and through the Python handle, at each
concurrency, and reads the CPU per lifecycle by process and, from the registry's
stats, the items per Encoder call and the requests per registry submit call. Prints
one JSON object of medians over rounds, with batched / single ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import ray
from ray import serve

from benchmarks import service_cpu, standin
from benchmarks.cluster import local_cluster, run_token, start_serve
from benchmarks.scale_out import BatchRank

VARIANTS: dict[str, dict[str, int]] = {
    "single": {"encoder_call_max_items": 1, "registry_call_max_requests": 1},
    "batched": {},  # the defaults
}
RECEIVE_COUNT = 4
PROCESSES = ("service", "registry", "ingress", "encoder", "ranks", "proxy")


def _calls(registry: Any) -> tuple[int, int, int, int]:
    stats = ray.get(registry.stats.remote())
    return (stats["encoder_calls_total"], stats["encoder_call_items_total"],
            stats["submit_calls_total"], stats["submitted_requests_total"])


def measure(lifecycles: int, concurrencies: list[int], rounds: int) -> dict[str, Any]:
    token = run_token()
    namespace = f"epd-batching-{token}"
    samples: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    with local_cluster(namespace):
        http_url = start_serve()["http_url"]
        apps = {}
        for variant, overrides in VARIANTS.items():
            app, registry_name = f"bench-{variant}", f"batching_{variant}_{token}"
            serve.run(standin.application([standin.TINY], registry_name, namespace, **overrides), name=app,
                      route_prefix=f"/{app}")
            apps[variant] = (app, registry_name, ray.get_actor(registry_name, namespace=namespace))
        ranks = [BatchRank.remote(rank) for rank in range(RECEIVE_COUNT)]
        ray.get([rank.pid.remote() for rank in ranks])
        for _ in range(rounds):
            for concurrency in concurrencies:
                for variant, (app, registry_name, registry) in apps.items():
                    before = _calls(registry)
                    rows = service_cpu.measure(ranks, registry_name, namespace, http_url, lifecycles, concurrency, app)
                    calls, items, submits, requests = (a - b for a, b in zip(_calls(registry), before, strict=True))
                    for path, row in rows.items():
                        # Both paths ran between the two reads: the call counts are theirs together.
                        sample = {f"{p}_ms": row["cpu_ms_per_lifecycle"][p] for p in PROCESSES}
                        sample |= {"lifecycles_per_s": row["lifecycles_per_s"], "items_per_encoder_call": items / calls,
                                   "requests_per_submit_call": requests / submits}
                        samples.setdefault((variant, concurrency, path), []).append(sample)
    out: dict[str, Any] = {"settings": {"lifecycles": lifecycles, "concurrencies": concurrencies, "rounds": rounds,
                                        "receive_count": RECEIVE_COUNT, "variants": VARIANTS}}
    for (variant, concurrency, path), rows in samples.items():
        medians = {key: round(statistics.median(row[key] for row in rows), 2) for key in rows[0]}
        out.setdefault(f"concurrency_{concurrency}", {}).setdefault(path, {})[variant] = medians
    for by_path in (value for key, value in out.items() if key.startswith("concurrency_")):
        for row in by_path.values():
            row["batched_vs_single"] = {
                key: round(row["batched"][key] / row["single"][key], 2)
                for key in ("service_ms", "registry_ms", "ingress_ms", "encoder_ms") if row["single"][key]
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lifecycles", type=int, default=300, help="lifecycles per path, variant and round (default 300)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64], help="encodes in flight (default 16 64)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    args = parser.parse_args()
    print(json.dumps(measure(args.lifecycles, args.concurrency, args.rounds), indent=2))


if __name__ == "__main__":
    main()
