"""The registry's metrics (Ray metrics API: Ray dashboard and Prometheus, ``ray_`` prefixed).

Kept out of the state machine so the rules stay testable without Ray; the actor
reports every change through ``RegistryMetrics``.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

_LATENCY_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]


class RegistryMetrics:
    def __init__(self, registry_name: str):
        tags = {"registry": registry_name}
        self._seen: dict[str, int] = {}
        self.encode_requests = Counter(
            "epd_encode_requests_total", "Encode requests by result (accepted, duplicate, rejected).",
            tag_keys=("registry", "result"),
        ).set_default_tags(tags)
        self.encode_latency = Histogram(
            "epd_encode_latency_s", "Seconds from accepting an encode to staging its embeddings.",
            boundaries=_LATENCY_BOUNDARIES_S, tag_keys=("registry",),
        ).set_default_tags(tags)
        self.pending = Gauge("epd_pending_entries", "Entries being encoded.", tag_keys=("registry",)).set_default_tags(tags)
        self.staged = Gauge("epd_staged_entries", "Entries staged and waiting for ranks.", tag_keys=("registry",)).set_default_tags(tags)
        self.staged_bytes = Gauge("epd_staged_bytes", "Bytes of staged embeddings held by the registry.", tag_keys=("registry",)).set_default_tags(tags)
        self.fetches = Counter(
            "epd_fetches_total", "Rank fetches by result (ok, released, or an error code).",
            tag_keys=("registry", "result"),
        ).set_default_tags(tags)
        self.ended = Counter(
            "epd_entries_ended_total", "Entries that reached a terminal state (released, expired, cancelled, failed).",
            tag_keys=("registry", "state"),
        ).set_default_tags(tags)
        self.errors = Counter(
            "epd_errors_total", "Errors returned by the registry, by code.", tag_keys=("registry", "code"),
        ).set_default_tags(tags)
        self.late_results = Counter(
            "epd_late_results_total", "Encode results dropped because their entry had already ended.",
            tag_keys=("registry",),
        ).set_default_tags(tags)

    def sync(self, stats: dict[str, int]) -> None:
        """Publish ``RegistryState.stats()``: gauges as they are, totals as counter deltas."""
        self.pending.set(stats["pending"])
        self.staged.set(stats["staged"])
        self.staged_bytes.set(stats["staged_bytes"])
        for state in ("released", "expired", "cancelled", "failed"):
            total = stats[f"{state}_total"]
            delta = total - self._seen.get(state, 0)
            if delta > 0:
                self.ended.inc(delta, tags={"state": state})
                self._seen[state] = total
