"""The benchmark's own local Ray cluster, and readings taken from it.

The benchmark never joins a cluster it did not start (``address="local"``, and
``RAY_ADDRESS`` is ignored), runs in a namespace of its own, names its registry
actors after a per-run token, and at the end shuts down exactly what it started
(the pre-faulted node's processes, then ``ray.shutdown()`` of the cluster it
started). It never runs ``ray stop``, which would kill every Ray process on the
machine.

Workers import ``benchmarks`` and the project's packages from the repository
root, which is put on the ``PYTHONPATH`` of this process before Ray starts, so that
every Ray process inherits it (the checkout need not be installed). Not a job
``runtime_env``: every worker of a job with one starts through Ray's runtime-env
agent and a setup step, measured here at 0.4 CPU-s more per worker (about 20 of them).
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

from benchmarks.ray_internals import start_node, stop_monitor

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Logical CPUs, not the machine's: actors and replicas ask for few or none, and the
# Encoder replicas ask for 2 so that Ray gives them two intra-op threads (see end_to_end).
CLUSTER_CPUS = 8
# Explicit, so that the benchmark never takes 30% of a shared machine's memory.
OBJECT_STORE_BYTES = 2 * 1024**3
# The pre-faulted node runs the staging section alone, whose largest burst holds about
# 150 MB; its raylet faults every byte in at start (a 2 GiB store cost it 4.7 CPU-s).
PREFAULTED_STORE_BYTES = 512 * 1024**2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_token() -> str:
    return secrets.token_hex(4)


@contextlib.contextmanager
def local_cluster(namespace: str) -> Iterator[dict[str, Any]]:
    """Start a fresh local Ray cluster (no Serve yet: ``start_serve``); yield its settings."""
    os.environ.pop("RAY_ADDRESS", None)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(REPO_ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), *paths]))
    ray.init(
        address="local",
        num_cpus=CLUSTER_CPUS,
        num_gpus=0,
        namespace=namespace,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,  # replica logs would tear the progress bar apart
        logging_level="WARNING",
    )
    try:
        yield {
            "namespace": namespace,
            "num_cpus_logical": CLUSTER_CPUS,
            "object_store_bytes": OBJECT_STORE_BYTES,
            "preallocate_plasma_memory": False,
            "prefaulted_node_object_store_bytes": PREFAULTED_STORE_BYTES,
        }
    finally:
        # No serve.shutdown(): it stops every replica gracefully, one by one (seconds), and
        # ray.shutdown() ends this cluster's every process anyway, since this driver started it.
        stop_monitor()
        ray.shutdown()


def start_serve() -> dict[str, Any]:
    """Start Serve on the cluster, HTTP on a free port of 127.0.0.1; its settings."""
    from ray import serve

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its INFO lines would tear the progress bar
    port = free_port()
    # HeadOnly: the pre-faulted node (start_prefaulted_node) must not get a proxy of its own.
    serve.start(
        proxy_location="HeadOnly",
        http_options={"host": "127.0.0.1", "port": port},
        logging_config={"log_level": "WARNING"},
    )
    return {"http_url": f"http://127.0.0.1:{port}"}


def start_prefaulted_node(resource: str) -> Any:
    """Add a second node to the running cluster, on this machine, whose object store its
    raylet pre-faults at start (``RAY_preallocate_plasma_memory=1``); work that asks for
    ``resource`` runs there. Returns the node, for ``benchmarks.ray_internals.remove_node``.

    It has no CPUs, so nothing that does not ask for ``resource`` is placed on it. It is
    started as ``ray.cluster_utils.Cluster.add_node`` starts one (Ray's ``Node``): a
    second cluster would cost its own GCS, dashboard, monitors, driver and Serve
    controller, and ``ray start`` would leave processes only ``ray stop`` ends. Callable
    from any thread (no exit hooks: they set signal handlers). The node's processes get
    the kernel's parent-death signal when the *thread* that started them ends, so that
    thread must outlive the node's use; ``remove_node`` ends them.
    """
    return start_node({resource: 1}, PREFAULTED_STORE_BYTES, {"RAY_preallocate_plasma_memory": "1"})


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


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
    }
