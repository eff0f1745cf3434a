"""What a vLLM scheduler's question about an item costs: ``python -m benchmarks.engine_view``.

``RayRegistryECConnector.has_cache_item`` (asked at least twice per item per
scheduling step) reads the scheduler's local ``EngineView``; asking the registry
instead would cost one actor round trip each. Measured side by side on a quiet
local cluster, interleaved round by round so both see the same machine:

* ``view_has_ns``: one ``EngineView.has`` over a view of ``--items`` tracked items
  (what ``has_cache_item`` does besides one attribute lookup);
* ``states_round_trip_us``: one ``registry.states([req_id])`` call, the batched
  query a connector without a view would make per question;
* ``noop_round_trip_us``: one no-op registry call (``ping``), the floor of any call.

Prints one JSON object: medians over ``--rounds`` rounds and the ratio of a round
trip to a view read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray

from deployments.config import AppConfig
from registry.engines.vllm.scheduler_view import EngineView
from registry.server.create import get_or_create_registry


def _view(items: int) -> tuple[EngineView, list[str]]:
    view = EngineView()
    identifiers = [f"item-{i}" for i in range(items)]
    for start in range(0, items, 4):  # requests of four images
        view.track(f"chat-{start}", identifiers[start:start + 4])
    view.apply({identifier: ("staged" if i % 2 else "pending") for i, identifier in enumerate(identifiers)})
    return view, identifiers


def measure(items: int, rounds: int, reads_per_round: int) -> dict[str, float]:
    view, identifiers = _view(items)
    settings = AppConfig(registry_name="engine-view-bench", registry_namespace="epd-bench").registry_settings("epd")
    registry = get_or_create_registry(settings)
    ray.get(registry.ping.remote())
    has_ns, states_us, noop_us = [], [], []
    for r in range(rounds):
        probe = identifiers[r % items]
        started = time.perf_counter_ns()
        for i in range(reads_per_round):
            view.has(identifiers[i % items])
        has_ns.append((time.perf_counter_ns() - started) / reads_per_round)
        started = time.perf_counter_ns()
        ray.get(registry.states.remote([probe]))
        states_us.append((time.perf_counter_ns() - started) / 1e3)
        started = time.perf_counter_ns()
        ray.get(registry.ping.remote())
        noop_us.append((time.perf_counter_ns() - started) / 1e3)
    ray.kill(registry)
    view_ns = statistics.median(has_ns)
    states = statistics.median(states_us)
    return {
        "items_in_view": items,
        "rounds": rounds,
        "view_has_ns": round(view_ns, 1),
        "states_round_trip_us": round(states, 1),
        "noop_round_trip_us": round(statistics.median(noop_us), 1),
        "round_trip_per_view_read": round(states * 1e3 / view_ns),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=4096, help="items the view tracks (default 4096)")
    parser.add_argument("--rounds", type=int, default=300, help="interleaved rounds (default 300)")
    parser.add_argument("--reads", type=int, default=1000, help="view reads per round (default 1000)")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, namespace="epd-bench", log_to_driver=False)
    try:
        print(json.dumps(measure(args.items, args.rounds, args.reads), indent=2))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
