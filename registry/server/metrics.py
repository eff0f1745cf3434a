"""The registry's metrics (Ray metrics API: Ray dashboard and Prometheus, ``ray_`` prefixed).

Kept out of the state machine so the rules stay testable without Ray; the actor
publishes ``RegistryState.stats()`` and the cache's stats through ``sync`` at most
every 0.5 s while the table changes (``registry.server.actor``'s publish loop): gauges as
they are, running totals as counter increments. The per-call counters (requests,
fetches, errors) are counted in this process and handed to Ray by ``flush`` on the
same loop: a Ray counter increment costs about as much as the registry's own work
for a fetch, and Prometheus reads them every few seconds anyway.
"""

from __future__ import annotations

from collections import Counter as _Count

from ray.util.metrics import Counter, Gauge, Histogram

_LATENCY_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
_ENDED_STATES = ("released", "expired", "cancelled", "failed")
_CACHE_EVENTS = {"cache_hits_total": "hit", "cache_misses_total": "miss", "cache_evictions_total": "eviction"}
# Running totals of the batched calls (``registry.server.batched_calls``, ``submit_many``): their
# ratios say how full the calls are.
_CALL_TOTALS = {
    "encoder_calls_total": ("epd_encoder_calls_total", "Calls the registry made to the Encoder deployment."),
    "encoder_call_items_total": ("epd_encoder_call_items_total", "Items those Encoder calls carried."),
    "submit_calls_total": ("epd_submit_calls_total", "submit and submit_many calls the registry served."),
    "submitted_requests_total": ("epd_submitted_requests_total", "Encode requests those submit calls carried."),
}


class _LocalCounter:
    """A Ray ``Counter``'s ``inc``, counted here until ``flush`` hands the sums to Ray."""

    def __init__(self, counter: Counter):
        self._counter = counter
        self._counts: _Count[tuple[tuple[str, str], ...]] = _Count()

    def inc(self, value: int = 1, tags: dict[str, str] | None = None) -> None:
        self._counts[tuple(sorted((tags or {}).items()))] += value

    def flush(self) -> None:
        counts, self._counts = self._counts, _Count()
        for tags, value in counts.items():
            self._counter.inc(value, tags=dict(tags))


class RegistryMetrics:
    def __init__(self, registry_name: str, shard: int = 0):
        # Each shard publishes its own series; a dashboard sums them over ``shard``.
        tags = {"registry": registry_name, "shard": str(shard)}
        self._seen: dict[str, int] = {}

        def counter(name: str, description: str, *keys: str) -> Counter:
            return Counter(name, description, tag_keys=("registry", "shard", *keys)).set_default_tags(tags)

        def local_counter(name: str, description: str, *keys: str) -> _LocalCounter:
            return _LocalCounter(counter(name, description, *keys))

        def gauge(name: str, description: str) -> Gauge:
            return Gauge(name, description, tag_keys=("registry", "shard")).set_default_tags(tags)

        self.encode_requests = local_counter(
            "epd_encode_requests_total", "Encode requests by result (accepted, duplicate, rejected).", "result"
        )
        self.encode_latency = Histogram(
            "epd_encode_latency_s", "Seconds from accepting an encode to staging its embeddings.",
            boundaries=_LATENCY_BOUNDARIES_S, tag_keys=("registry", "shard"),
        ).set_default_tags(tags)
        self.pending = gauge("epd_pending_entries", "Entries being encoded.")
        self.staged = gauge("epd_staged_entries", "Entries staged and waiting for ranks.")
        self.staged_bytes = gauge("epd_staged_bytes", "Bytes of staged embeddings held by entries.")
        self.fetches = local_counter(
            "epd_fetches_total", "Rank fetches by result (ok, released, or an error code) and transport (ray, zmq, http).",
            "result", "transport",
        )
        # Observed as each fetch ends, as encode_latency is as each encode ends.
        self.fetch_latency = Histogram(
            "epd_fetch_latency_s",
            "Seconds from a rank's fetch (for zmq: its push registration) to its answer (for zmq: the acknowledgement), "
            "waiting while pending included, by transport.",
            boundaries=_LATENCY_BOUNDARIES_S, tag_keys=("registry", "shard", "transport"),
        ).set_default_tags(tags)
        self.ended = counter(
            "epd_entries_ended_total", "Entries that reached a terminal state (released, expired, cancelled, failed).",
            "state",
        )
        self.errors = local_counter("epd_errors_total", "Errors returned by the registry, by code.", "code")
        self.late_results = counter(
            "epd_late_results_total", "Encode results dropped because their entry had already ended."
        )
        self.cache_bytes = gauge("epd_cache_bytes", "Bytes of embeddings held by the content-hash cache.")
        self.cache_events = counter(
            "epd_cache_events_total", "Content-hash cache lookups and evictions (hit, miss, eviction).", "event"
        )
        self.call_totals = {key: counter(name, description) for key, (name, description) in _CALL_TOTALS.items()}

    def flush(self) -> None:
        """Hand the per-call counts made since the last flush to Ray."""
        for counter in (self.encode_requests, self.fetches, self.errors):
            counter.flush()

    def sync(self, stats: dict[str, int]) -> None:
        self.pending.set(stats["pending"])
        self.staged.set(stats["staged"])
        self.staged_bytes.set(stats["staged_bytes"])
        self.cache_bytes.set(stats["cache_bytes"])
        for state in _ENDED_STATES:
            self._count(self.ended, f"{state}_total", stats, {"state": state})
        for key, event in _CACHE_EVENTS.items():
            self._count(self.cache_events, key, stats, {"event": event})
        for key, total in self.call_totals.items():
            self._count(total, key, stats, {})

    def _count(self, counter: Counter, key: str, stats: dict[str, int], tags: dict[str, str]) -> None:
        delta = stats[key] - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta, tags=tags)
            self._seen[key] = stats[key]
