"""What the tests read from Ray's private modules: who references which object, the session's
log folder, a cluster-wide garbage collection. Ray has no public API for these; they change
between Ray releases, so they are kept in one file (the benchmark's readings are in
``benchmarks/cluster.py``)."""

from __future__ import annotations

from typing import Any

import ray

# Processes of Serve's control plane, left out of the reference accounting: what they hold
# is Serve's bookkeeping, which moves with replica churn and HTTP history, not with data.
SERVE_CONTROL_PLANE = ("ServeController", "ProxyActor")


def global_gc() -> None:
    """Run the garbage collector in every worker of the cluster."""
    from ray._private.internal_api import global_gc as _global_gc

    _global_gc()


def logs_dir() -> str:
    """This cluster's session log folder (Serve's replica logs are under ``serve/``)."""
    return ray._private.worker.global_worker.node.get_logs_dir_path()


# An object id's last 4 bytes are its index within the task that made it: the task's
# returns (owned by its caller) count from 1, what it ``ray.put`` (owned by the process
# that ran it) from 100,000,001.
_FIRST_PUT_INDEX = 100_000_001


def _put_by_the_task(object_id: bytes) -> bool:
    return int.from_bytes(object_id[24:28], "little") >= _FIRST_PUT_INDEX


def object_refs_in_use() -> dict[bytes, tuple[int, list[str]]]:
    """Every object the cluster's processes reference, Serve's control plane aside:
    object id -> (size in bytes, or -1 when unknown; holders as "Class:pid").

    Left out, because they are Serve's bookkeeping and move with replica churn,
    config updates and HTTP history, not with data this project stages (all seen
    here): what the controller and HTTP proxies hold (an object of about 110 KB
    per replica, 15-byte objects per past request), wherever else it is held too (a
    starting replica holds the ~110 KB creation and initialization arguments the
    controller sent it until its model is loaded), and the controller's replies that
    every process with a handle keeps (long-poll config snapshots, ~110 KB).

    Left out too: what a dead actor ``ray.put``. Ray frees an object with its owner, whatever
    refs to it remain (measured: the store's bytes in use fell to 0 when the owner was
    killed while two processes still held refs), so a ref left to one holds no memory.
    """
    from ray._private import internal_api
    from ray._private.state import actors
    from ray.core.generated import common_pb2

    table = actors()
    classes = {aid: a.get("ActorClassName") for aid, a in table.items()}
    control_plane = {bytes.fromhex(aid) for aid, cls in classes.items() if cls in SERVE_CONTROL_PLANE}
    dead = {bytes.fromhex(aid) for aid, a in table.items() if a.get("State") == "DEAD"}
    refs: dict[bytes, tuple[int, list[str]]] = {}
    bookkeeping: set[bytes] = set()  # what the control plane holds
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        try:
            stats = internal_api.node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=True)
        except Exception:  # noqa: BLE001 - a node that just died and is not marked dead yet holds nothing
            continue
        for worker in stats.core_workers_stats:
            holder: Any = classes.get(worker.actor_id.hex()) or common_pb2.WorkerType.Name(worker.worker_type).lower()
            if holder in SERVE_CONTROL_PLANE:
                bookkeeping.update(ref.object_id for ref in worker.object_refs)
                continue
            for ref in worker.object_refs:
                # An object id is the id of the task that made it (8 bytes, then the
                # actor's 16) and an index; skip what the control plane's tasks returned.
                actor = ref.object_id[8:24]
                if actor in control_plane or (actor in dead and _put_by_the_task(ref.object_id)):
                    continue
                size, holders = refs.get(ref.object_id, (-1, []))
                refs[ref.object_id] = (max(size, ref.object_size), [*holders, f"{holder}:{worker.pid}"])
    return {oid: held for oid, held in refs.items() if oid not in bookkeeping}


def _pause_collection(_instance: Any) -> None:
    import gc

    gc.collect()
    gc.disable()


def _garbage_frames(_instance: Any, folders: tuple[str, ...]) -> list[str]:
    """The frames of code under ``folders`` that only a collection would free; collection on again."""
    import gc
    import os
    import types

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        frames = sorted({f"{os.path.basename(o.f_code.co_filename)}:{o.f_code.co_name}" for o in gc.garbage
                         if isinstance(o, types.FrameType) and any(f"/{d}/" in o.f_code.co_filename for d in folders)})
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
    return frames


class CycleWatch:
    """Reference cycles that actors' code leaves, over a ``with`` block: on entry each actor
    collects and turns its garbage collector off (``__ray_call__`` runs a function in the
    actor's process); on exit ``found`` lists, per actor, the frames of project code
    (``folders``) in what a collection finds unreachable, and the collector is on again.
    With it off, a cycle cannot be freed by a collection that happened to run in between."""

    def __init__(self, actors: list[Any], folders: tuple[str, ...] = ("deployments", "registry", "encoder")):
        self.actors, self.folders = actors, folders
        self.found: list[list[str]] = []

    @classmethod
    def of_app(cls, app: str, deployments: tuple[str, ...], others: tuple[Any, ...] = ()) -> "CycleWatch":
        """The replicas of ``deployments`` of Serve app ``app``, and ``others``."""
        named = ray.util.list_named_actors(all_namespaces=True)
        replicas = []
        for deployment in deployments:
            found = [a for a in named if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")]
            assert found, f"no replica of {app}/{deployment} among the named actors"  # else it would watch nothing
            replicas += [ray.get_actor(a["name"], namespace=a["namespace"]) for a in found]
        return cls([*replicas, *others])

    def __enter__(self) -> "CycleWatch":
        ray.get([actor.__ray_call__.remote(_pause_collection) for actor in self.actors])
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.found = ray.get([actor.__ray_call__.remote(_garbage_frames, self.folders) for actor in self.actors])
