"""Every reach into Ray's private modules, for the benchmark and the tests' accounting.

Ray has no public API for what a measurement needs to read: the object store's usage,
which process references which object, how many calls an actor's process has run, the
session's log folder; nor for starting a node in-process or stopping the autoscaler's
monitor quickly. These come from ``ray._private`` and the raylets' stats, which change
between Ray releases: kept here, so that an upgrade breaks this one file, not many.
The service itself (``registry``, ``deployments``, ``encoder``) uses none of it.
"""

from __future__ import annotations

import os
from typing import Any

import ray

# Processes of Serve's control plane, left out of the reference accounting: what they hold
# is Serve's bookkeeping, which moves with replica churn and HTTP history, not with data.
SERVE_CONTROL_PLANE = ("ServeController", "ProxyActor")


def _memory_state() -> Any:
    from ray._private import internal_api

    return internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)


def object_store_usage() -> tuple[int, int]:
    """(bytes used, objects) in the shared-memory object store of every node (the raylets' figure)."""
    from ray._private import internal_api

    stats = internal_api.get_memory_info_reply(_memory_state()).store_stats
    return int(stats.object_store_bytes_used), int(stats.num_local_objects)


def global_gc() -> None:
    """Run the garbage collector in every worker of the cluster."""
    from ray._private.internal_api import global_gc as _global_gc

    _global_gc()


def _node_stats(node: dict[str, Any], include_memory_info: bool) -> Any:
    from ray._private import internal_api

    return internal_api.node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=include_memory_info)


def executed_tasks(actor: Any) -> int:
    """Calls the process of ``actor`` has executed, as its raylet counts them.

    Read from the raylet, not from the actor, so that counting does not add a call.
    """
    actor_id = actor._actor_id.binary()
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        for worker in _node_stats(node, include_memory_info=False).core_workers_stats:
            if worker.actor_id == actor_id:
                return int(worker.num_executed_tasks)
    raise RuntimeError("the actor's worker was not found in any raylet's stats")


def object_refs_in_use() -> dict[bytes, tuple[int, list[str]]]:
    """Every object the cluster's processes reference, Serve's control plane aside:
    object id -> (size in bytes, or -1 when unknown; holders as "Class:pid").

    Left out, because they are Serve's bookkeeping and move with replica churn,
    config updates and HTTP history, not with data this project stages (all seen
    here): what the controller and HTTP proxies hold (an object of about 110 KB
    per replica, 15-byte objects per past request), and the controller's replies
    that every process with a handle keeps (long-poll config snapshots, ~110 KB).
    """
    from ray._private.state import actors
    from ray.core.generated import common_pb2

    classes = {aid: a.get("ActorClassName") for aid, a in actors().items()}
    control_plane = {bytes.fromhex(aid) for aid, cls in classes.items() if cls in SERVE_CONTROL_PLANE}
    refs: dict[bytes, tuple[int, list[str]]] = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        try:
            stats = _node_stats(node, include_memory_info=True)
        except Exception:  # noqa: BLE001 - a node that just died and is not marked dead yet holds nothing
            continue
        for worker in stats.core_workers_stats:
            holder = classes.get(worker.actor_id.hex()) or common_pb2.WorkerType.Name(worker.worker_type).lower()
            if holder in SERVE_CONTROL_PLANE:
                continue
            for ref in worker.object_refs:
                # An object id is the id of the task that made it (8 bytes, then the
                # actor's 16) and an index; skip what the control plane's tasks returned.
                if ref.object_id[8:24] in control_plane:
                    continue
                size, holders = refs.get(ref.object_id, (-1, []))
                refs[ref.object_id] = (max(size, ref.object_size), [*holders, f"{holder}:{worker.pid}"])
    return refs


def logs_dir() -> str:
    """This cluster's session log folder (Serve's replica logs are under ``serve/``)."""
    return ray._private.worker.global_worker.node.get_logs_dir_path()


def stop_monitor() -> None:
    """Stop the autoscaler's monitor of the cluster this driver started, at once.

    ``ray.shutdown()`` gives each process a second to exit on SIGTERM, which the monitor
    (idle without autoscaling) never does: measured 1.0 s of a 1.4 s shutdown.
    """
    node = ray._private.worker._global_node
    if node is not None:
        node.kill_monitor(check_alive=False)


def start_node(resources: dict[str, float], object_store_bytes: int, env: dict[str, str]) -> Any:
    """Start a node with no CPUs on this machine, joined to the running cluster, as
    ``ray.cluster_utils.Cluster.add_node`` does (Ray's ``Node``); ``env`` is set for its
    raylet while it starts. Returns the node, for ``remove_node``."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams
    from ray._private.services import wait_for_node

    head = ray._private.worker.global_worker.node
    params = RayParams(
        gcs_address=head.gcs_address,
        num_cpus=0,
        num_gpus=0,
        resources=resources,
        object_store_memory=object_store_bytes,
        include_log_monitor=False,  # the head's log monitor covers this machine
        node_manager_port=0,
        min_worker_port=0,
        max_worker_port=0,
    )
    params.dashboard_agent_listen_port = None  # a free port, not the head agent's
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        node = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=True)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        wait_for_node(node.gcs_address, node.plasma_store_socket_name, 60)
    except BaseException:
        remove_node(node)
        raise
    return node


def remove_node(node: Any) -> None:
    """End every process of a node that ``start_node`` started."""
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
