"""``deployments.autoscaling.scale_on_items``: the Encoder scales on items, however many calls
carried them, and serve_config.yaml's commented example is a valid Serve autoscaling config."""

import pathlib
import re

import pytest
import yaml
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.autoscaling import ITEMS_METRIC, scale_on_items

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOYMENT = DeploymentID(name="Encoder", app_name="epd")


def context(replicas: int, items: dict[str, float] | None, queued: float = 0, ongoing: float = 0, target: float = 4):
    ids = [ReplicaID(unique_id=name, deployment_id=DEPLOYMENT) for name in (items or {})]
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name="Encoder", app_name="epd",
        current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=ids,
        total_num_requests=ongoing, total_queued_requests=queued,
        aggregated_metrics={ITEMS_METRIC: dict(zip(ids, (items or {}).values()))} if items is not None else {},
        raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=0.0,
        config=AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=target),
    )


def test_the_replicas_asked_for_follow_the_items_not_the_calls():
    # Two calls in flight (Serve's count) carrying 24 items: 6 replicas at 4 items each.
    assert scale_on_items(context(2, {"a": 16, "b": 8}, ongoing=2))[0] == pytest.approx(6)
    # Calls queued in routers count one item each until a replica holds them.
    assert scale_on_items(context(2, {"a": 4, "b": 4}, queued=4, ongoing=6))[0] == pytest.approx(3)
    assert scale_on_items(context(2, {"a": 0, "b": 0}))[0] == 0


def test_before_any_report_serve_s_own_count_stands_in_and_zero_replicas_keep_the_target():
    assert scale_on_items(context(1, None, ongoing=12))[0] == pytest.approx(3)
    assert scale_on_items(context(0, None, ongoing=5))[0] == 0


def test_the_commented_example_in_serve_config_is_a_valid_autoscaling_config_for_this_policy():
    text = (ROOT / "serve_config.yaml").read_text()
    block = re.search(r"^( *)# autoscaling_config:\n((?:\1#   .*\n)+)", text, re.M)
    assert block, "serve_config.yaml lost its autoscaling_config example"
    lines = [line.split("#", 1)[1][1:].split("  #")[0].rstrip() for line in block.group(2).splitlines()]
    config = AutoscalingConfig.model_validate(yaml.safe_load("\n".join(lines)))
    assert config.policy.policy_function == "deployments.autoscaling:scale_on_items"
    assert config.target_ongoing_requests == 16 and (config.min_replicas, config.max_replicas) == (1, 4)
