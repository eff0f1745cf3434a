"""The registry runs at the CPU priority it is configured with (``registry_niceness``, default
0), not at the niceness 15 Ray starts its workers with: on a node whose cores a CPU-bound
engine fills, a registry at 15 answered too slowly for the engine's requests to get their
items (``registry.server.priority``)."""

import os

import ray

from registry import lookup_shards


def _nice_of_threads(pid: int) -> dict[int, int]:
    """Each thread's niceness, from ``/proc/<pid>/task/<tid>/stat`` (its 19th field)."""
    nice = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        nice[int(tid)] = int(fields[16])
    return nice


def test_every_thread_of_every_registry_shard_runs_at_niceness_0_while_ray_s_workers_run_at_15(cluster):
    shards = lookup_shards()  # the suite's app runs under the default registry name
    assert len(shards) == cluster.app_args["registry_shards"]
    for handle in shards.handles:
        pid = ray.get(handle.ping.remote())["pid"]
        threads = _nice_of_threads(pid)
        assert len(threads) > 1 and set(threads.values()) == {0}, (pid, threads)
    # A worker Ray started as usual, for contrast: its main thread, which runs its calls,
    # is at what the registry's would run at otherwise.
    rank_pid = ray.get(cluster.ranks[0].__ray_call__.remote(lambda self: os.getpid()))
    assert _nice_of_threads(rank_pid)[rank_pid] == 15
