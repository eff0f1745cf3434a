"""The registry's CPU priority.

Ray starts its worker processes, this actor's among them, at niceness 15 (its
``worker_niceness``), below everything else on the node. The registry does little work,
but every hand-off waits on its answers. On a node whose cores a CPU-bound engine keeps
busy (vLLM's TP workers spin between steps: at TP 2 on two cores they took both), it got
almost no CPU at niceness 15, and the engine's requests waited for answers past ``ttl_s``.
So the actor sets its own niceness when it starts (``registry_niceness``, default 0: the
priority of the engines it serves).

On Linux a niceness belongs to each thread, and a new thread takes its creator's: every
thread of the process is set, those Ray started before the actor's code ran included.
Lowering a niceness needs ``CAP_SYS_NICE`` (root has it). Without it the registry logs one
warning and runs at Ray's; starting Ray with ``RAY_worker_niceness=0`` does the same for
every worker of the cluster.
"""

from __future__ import annotations

import os

from registry.logs import get_logger

logger = get_logger("registry.server.actor")
_warned: set[int] = set()  # the niceness values already warned about, once per process


def set_niceness(niceness: int | None) -> bool:
    """Set every thread of this process to ``niceness`` (None: leave them). False, with a
    warning in the log, if the system refused; True otherwise."""
    if niceness is None or not hasattr(os, "setpriority"):
        return True
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]  # not Linux's /proc: the calling thread (the whole process elsewhere)
    for tid in threads:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as exc:
            if niceness in _warned:
                return False
            _warned.add(niceness)
            logger.warning(
                "the registry could not set its niceness to %d (%s: %s) and runs at %d: on a node whose cores "
                "busy processes fill, it may answer slowly. Grant the process CAP_SYS_NICE, start Ray with "
                "RAY_worker_niceness=%d, or set registry_niceness to null to keep Ray's",
                niceness, type(exc).__name__, exc, os.getpriority(os.PRIO_PROCESS, 0), niceness,
            )
            return False
    return True
