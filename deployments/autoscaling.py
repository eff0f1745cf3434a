"""Autoscaling the ``Encoder`` on the items it holds, not on the calls that brought them.

Serve's default policy scales on ongoing requests, and one Encoder call carries up
to ``encoder_call_max_items`` items (``registry.server.batched_calls``), so under load its
count understates the work. Each replica reports its items in progress
(``Encoder.record_autoscaling_stats``); this policy asks for
``items / target_ongoing_requests`` replicas, so ``target_ongoing_requests`` reads as
items per replica. Serve applies ``min_replicas``, ``max_replicas``, the up- and
downscale delays and the scaling factors around it, as for its own policy::

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      target_ongoing_requests: 16      # items per replica
      policy:
        policy_function: deployments.autoscaling:scale_on_items

The controller imports this module by that path: the project must be installed
where it runs (``pip install -e .``, as the README's commands do).
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext

# The name under which each Encoder replica reports its items in progress.
ITEMS_METRIC = "items_in_progress"


def scale_on_items(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    """The replicas the Encoder needs for the items it holds and the calls queued for it."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    reported = (ctx.aggregated_metrics or {}).get(ITEMS_METRIC) or {}
    if not reported:  # no replica has reported yet (just started): Serve's own count
        items = ctx.total_num_requests
    else:
        # Calls queued in callers' routers are in no replica yet: each holds at least one item.
        items = sum(reported.values()) + (ctx.total_queued_requests or 0)
    return items / ctx.config.get_target_ongoing_requests(), {}
