"""Where the CPU goes: CPU seconds per unit of work, by process, for the diagnoses.

On a 2-core machine every process of the run competes for the same cores, so a
throughput ratio is often explained by CPU time: if the registry process spends
3 ms of CPU per lifecycle, no client can get more than ~330 lifecycles/s out of
it. ``CpuMeter`` reads ``utime + stime`` from ``/proc`` for this driver and every
process it started (the raylet, the GCS and, under the raylet, every worker) at
the start and end of a timed window and groups them by role, named from Ray's
process titles (``ray::EmbeddingRegistry``, ``ray::ServeReplica:<app>:Encoder``,
``ray::ProxyActor``, ...). Linux only; elsewhere it reports nothing.
"""

from __future__ import annotations

import os
from typing import Callable

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the command: state, ppid, ..., utime and stime are fields 14 and 15 of stat(5).
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _tree(root: int) -> dict[int, float]:
    """CPU seconds of ``root`` and all its descendants."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            stats[int(entry)] = stat
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = stats[pid][1]
        todo += children.get(pid, [])
    return out


class CpuLedger:
    """CPU seconds used so far by this process and every process it started (the Ray
    cluster included). A process that has exited keeps the CPU time it had when last
    seen, so the total never goes down; what it used after the last look is missed."""

    def __init__(self) -> None:
        self._seen: dict[int, float] = {}

    def total(self) -> float:
        if os.path.isdir("/proc"):
            for pid, seconds in _tree(os.getpid()).items():
                self._seen[pid] = max(self._seen.get(pid, 0.0), seconds)
        return sum(self._seen.values())


class CpuMeter:
    """``with CpuMeter(classify) as m: ...`` then ``m.by_role``: CPU seconds per role in the window.

    ``classify(pid, title)`` names a process's role; ``"other"`` collects the rest and
    ``"all"`` is the sum. The driver itself is ``"driver"``.
    """

    def __init__(self, classify: Callable[[int, str], str | None]):
        self._classify = classify
        self.by_role: dict[str, float] = {}
        self.other: dict[str, float] = {}  # the "other" role by process title, for the diagnosis

    def __enter__(self) -> "CpuMeter":
        self._before = _tree(os.getpid()) if os.path.isdir("/proc") else {}
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._before:
            return
        after = _tree(os.getpid())
        roles: dict[str, float] = {}
        for pid, seconds in after.items():
            spent = seconds - self._before.get(pid, 0.0)
            title = _title(pid)
            role = "driver" if pid == os.getpid() else (self._classify(pid, title) or "other")
            roles[role] = roles.get(role, 0.0) + spent
            if role == "other":
                name = title.rsplit("/", 1)[-1][:60]
                self.other[name] = self.other.get(name, 0.0) + spent
        roles["all"] = sum(roles.values())
        self.by_role = roles


def by_title(roles: dict[str, str], pids: dict[int, str] | None = None) -> Callable[[int, str], str | None]:
    """A classifier: known ``pids`` first, then the first ``roles`` key found in the title."""

    def classify(pid: int, title: str) -> str | None:
        if pids and pid in pids:
            return pids[pid]
        return next((role for needle, role in roles.items() if needle in title), None)

    return classify
