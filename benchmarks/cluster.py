"""The benchmark's own local Ray cluster, and readings taken from it.

The benchmark never joins a cluster it did not start (``address="local"``, and
``RAY_ADDRESS`` is ignored), runs in a namespace of its own, names its registry
actors after a per-run token, and at the end shuts down exactly what it started
(``ray.shutdown()`` of the cluster it started). It never runs ``ray stop``, which
would kill every Ray process on the machine.

Workers import ``benchmarks`` and the project's packages from the repository
root, which is put on their ``PYTHONPATH`` (the checkout need not be installed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import platform
import secrets
import socket
import sys
from typing import Any, Iterator

import ray

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Logical CPUs, not the machine's: actors and replicas ask for few or none, and the
# Encoder replicas ask for 2 so that Ray gives them two intra-op threads (see end_to_end).
CLUSTER_CPUS = 8
# Small and explicit, so that pre-faulting it (RAY_preallocate_plasma_memory) stays cheap
# and the benchmark never takes 30% of a shared machine's memory.
OBJECT_STORE_BYTES = 2 * 1024**3
# The pre-faulted cluster runs the staging section alone, whose largest burst holds
# about 150 MB; every byte of it is faulted in at start (1.8 CPU-s per GiB here).
PREFAULTED_STORE_BYTES = 512 * 1024**2
# Ray prestarts idle workers for a new driver; none of this run's actors can take
# them (they carry the job's runtime_env), so each one idled through the whole run.
_SYSTEM_CONFIG = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_token() -> str:
    return secrets.token_hex(4)


@contextlib.contextmanager
def local_cluster(
    namespace: str, preallocate: bool = False, http: bool = True, object_store_bytes: int = OBJECT_STORE_BYTES
) -> Iterator[dict[str, Any]]:
    """Start a fresh local Ray cluster with Serve (HTTP on a free port, or no proxy at all
    without ``http``); yield its settings.

    ``preallocate`` asks the raylet to pre-fault the whole object store at start
    (``RAY_preallocate_plasma_memory``); the variable must be in the environment
    before the raylet starts, which ``ray.init`` does here.
    """
    from ray import serve

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its INFO lines would tear the progress bar
    os.environ.pop("RAY_ADDRESS", None)
    if preallocate:
        os.environ["RAY_preallocate_plasma_memory"] = "1"
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(
        address="local",
        num_cpus=CLUSTER_CPUS,
        num_gpus=0,
        namespace=namespace,
        object_store_memory=object_store_bytes,
        include_dashboard=False,
        log_to_driver=False,  # replica logs would tear the progress bar apart
        logging_level="WARNING",
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
        _system_config=_SYSTEM_CONFIG,
    )
    port = free_port()
    try:
        if http:
            serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
        else:
            serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        yield {
            "namespace": namespace,
            "http_url": f"http://127.0.0.1:{port}" if http else None,
            "num_cpus_logical": CLUSTER_CPUS,
            "object_store_bytes": object_store_bytes,
            "preallocate_plasma_memory": preallocate,
        }
    finally:
        # No serve.shutdown(): it stops every replica gracefully, one by one (seconds), and
        # ray.shutdown() ends this cluster's every process anyway, since this driver started it.
        ray.shutdown()
        if preallocate:
            os.environ.pop("RAY_preallocate_plasma_memory", None)


def object_store_used() -> int:
    """Bytes allocated in the shared-memory object store of every node (the raylet's figure)."""
    from ray._private import internal_api

    state = internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)
    return int(internal_api.get_memory_info_reply(state).store_stats.object_store_bytes_used)


def executed_tasks(actor: Any) -> int:
    """Calls the process of ``actor`` has executed, as its raylet counts them.

    Read from the raylet, not from the actor, so that counting does not add a call.
    """
    from ray._private import internal_api

    actor_id = actor._actor_id.binary()
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        stats = internal_api.node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
        for worker in stats.core_workers_stats:
            if worker.actor_id == actor_id:
                return int(worker.num_executed_tasks)
    raise RuntimeError("the actor's worker was not found in any raylet's stats")


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import numpy
    import torch

    cpu_model = None
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    gpu = torch.cuda.is_available()
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "ram_bytes": ram,
        "gpu": gpu,
        "gpu_name": torch.cuda.get_device_name(0) if gpu else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "numpy": numpy.__version__,
        "executable": sys.executable,
        "load_avg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
