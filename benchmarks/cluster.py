"""The benchmark's own local Ray cluster, and what is read from it: Ray's private stats, the CPU of its processes.

It never joins a cluster it did not start (``address="local"``, ``RAY_ADDRESS`` ignored) and
ends with ``ray.shutdown()`` of the one it started, never ``ray stop`` (which kills every Ray
process on the machine). The object store's usage and an actor's executed calls have no public
API: they are read from ``ray._private`` here, so that a Ray upgrade breaks this file only.
On 2 cores every process competes for the same cores, so CPU per unit of work explains a rate:
``CpuMeter`` reads the CPU times of the driver and every process it started, grouped by role.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pathlib
import platform
import secrets
import socket
import sys
import time
from typing import Any, Iterator

import psutil
import ray

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Logical CPUs, not the machine's: actors and replicas ask for few or none, and the
# Encoder replicas ask for 2 so that Ray gives them two intra-op threads (see end_to_end).
CLUSTER_CPUS = 8
# Explicit, so that the benchmark never takes 30% of a shared machine's memory.
OBJECT_STORE_BYTES = 2 * 1024**3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_token() -> str:
    return secrets.token_hex(4)


def tests_module(name: str) -> Any:
    """A helper module of ``tests/`` (a side venv's recipe, the engine checkpoints and flags)."""
    if str(REPO_ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / "tests"))
    return importlib.import_module(name)


@contextlib.contextmanager
def local_cluster(namespace: str) -> Iterator[dict[str, Any]]:
    """Start a fresh local Ray cluster (no Serve yet: ``start_serve``); yield its settings.

    Workers import the project from the repository root, put on ``PYTHONPATH`` before Ray
    starts so that every Ray process inherits it; not a job ``runtime_env``, whose workers
    start through Ray's runtime-env agent (0.4 CPU-s more each, measured here)."""
    os.environ.pop("RAY_ADDRESS", None)
    on_pythonpath(str(REPO_ROOT))
    slow_machine_env()
    ray.init(address="local", num_cpus=CLUSTER_CPUS, num_gpus=0, namespace=namespace,
             object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    try:
        yield {"namespace": namespace, "num_cpus_logical": CLUSTER_CPUS, "object_store_bytes": OBJECT_STORE_BYTES}
    finally:
        # No serve.shutdown(): it stops every replica gracefully, one by one (seconds), and
        # ray.shutdown() ends this cluster's every process anyway, since this driver started it.
        ray.shutdown()


def on_pythonpath(folder: str) -> None:
    """Put ``folder`` first on this process's ``PYTHONPATH``, which the Ray processes of a
    cluster started after this inherit (so every worker can import from it)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([folder, *paths])


# How long a Serve HTTP proxy may take to come up. Serve's controller gives a starting proxy
# three readiness checks of 5 s before it kills it and starts another, and serve.start() waits
# 60 s on the first one: on 2 cores shared with a pip install, a worker's start alone can
# take longer, and serve.start() then raises although a replacement proxy is on its way.
PROXY_READY_CHECK_S = "20"
PROXY_START_S = 300.0


def slow_machine_env() -> None:
    """Serve's proxy readiness check at ``PROXY_READY_CHECK_S``, for every cluster started after this.

    Ray's processes read it from the environment of the driver that starts the cluster."""
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", PROXY_READY_CHECK_S)


def serve_http(port: int | None = None, **options: Any) -> str:
    """Start Serve with HTTP on 127.0.0.1 (a free port unless given); its URL once the proxy answers.

    A first proxy that Serve gave up on while it was starting (see ``PROXY_READY_CHECK_S``)
    is waited out on the proxy's own health route rather than failing the caller."""
    import httpx
    from ray import serve

    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, **options)
    except (TimeoutError, ray.exceptions.ActorDiedError) as exc:
        logging.getLogger(__name__).warning("Serve's first HTTP proxy did not start (%s); waiting for its replacement",
                                            type(exc).__name__)
        serve.start(http_options={"host": "127.0.0.1", "port": port}, **options)  # the running controller's client
    deadline = time.monotonic() + PROXY_START_S
    while True:
        try:
            httpx.get(f"{url}/-/healthz", timeout=5)  # any answer: 503 until an app's routes are in
            return url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve's HTTP proxy at {url} did not answer within {PROXY_START_S:.0f} s")
        time.sleep(0.5)


def start_serve() -> dict[str, Any]:
    """Start Serve on the cluster, HTTP on a free port of 127.0.0.1; its settings."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its INFO lines would bury the progress lines
    return {"http_url": serve_http(logging_config={"log_level": "WARNING"})}


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import torch

    info = pathlib.Path("/proc/cpuinfo").read_text().splitlines() if os.path.exists("/proc/cpuinfo") else []
    cpu_model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu_model, "gpu_name": gpu, "python": platform.python_version(),
            "platform": platform.platform(), "torch": torch.__version__, "ray": ray.__version__}


def object_store_usage() -> tuple[int, int]:
    """(bytes used, objects) in the shared-memory object store of every node (the raylets' figure)."""
    from ray._private import internal_api

    state = internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)
    stats = internal_api.get_memory_info_reply(state).store_stats
    return int(stats.object_store_bytes_used), int(stats.num_local_objects)


def executed_tasks(actors: list[Any]) -> int:
    """Calls the processes of ``actors`` have executed, as their raylets count them: read
    from the raylets, not from the actors, so that counting adds no call."""
    from ray._private import internal_api

    wanted, total, found = {actor._actor_id.binary() for actor in actors}, 0, 0
    for node in ray.nodes():
        if node["Alive"]:
            stats = internal_api.node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
            for worker in stats.core_workers_stats:
                if worker.actor_id in wanted:
                    total, found = total + int(worker.num_executed_tasks), found + 1
    if found != len(wanted):
        raise RuntimeError(f"found {found} of {len(wanted)} actors' workers in the raylets' stats")
    return total


# Ray's and Serve's own processes, by a part of their titles.
SYSTEM_ROLES = {"ProxyActor": "proxy", "ServeController": "controller", "raylet/raylet": "raylet", "gcs_server": "gcs"}


def _tree() -> dict[int, tuple[psutil.Process, float]]:
    """(process, CPU seconds) of this process and all its descendants (the cluster it started)."""
    out = {}
    for proc in (me := psutil.Process(), *me.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            out[proc.pid] = (proc, times.user + times.system)
    return out


class CpuMeter:
    """``with CpuMeter(roles, pids) as m: ...`` then ``m.by_role``: CPU seconds per role in the window.

    A process's role is ``pids[pid]`` where known, else the first of ``roles`` (and of
    ``SYSTEM_ROLES``, which ``roles`` may rename) whose key is in its title, else ``"other"``;
    this driver is ``"driver"`` and ``"all"`` is the sum.
    """

    def __init__(self, roles: dict[str, str], pids: dict[int, str] | None = None):
        self._roles, self._pids = {**SYSTEM_ROLES, **roles}, {**(pids or {}), os.getpid(): "driver"}
        self.by_role: dict[str, float] = {}

    def _role(self, proc: psutil.Process) -> str:
        title = ""
        with contextlib.suppress(psutil.Error):  # read once the window has closed, and only where needed
            title = "" if proc.pid in self._pids else (proc.cmdline() or [""])[0]
        return self._pids.get(proc.pid) or next((role for needle, role in self._roles.items() if needle in title), "other")

    def __enter__(self) -> "CpuMeter":
        self._before = _tree()
        return self

    def __exit__(self, *exc: object) -> None:
        for pid, (proc, seconds) in _tree().items():
            role = self._role(proc)
            self.by_role[role] = self.by_role.get(role, 0.0) + seconds - self._before.get(pid, (None, 0.0))[1]
        self.by_role["all"] = sum(self.by_role.values())
