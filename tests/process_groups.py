"""A command run in a process group of its own, its output in a log file, and that whole group
ended afterwards: how the tests run ``serve run``, and the engine benchmark vLLM's servers.

A group of its own, because what such a command starts (a Ray cluster's raylet and GCS, an
engine core and its workers) must end with it, and nothing else may: never ``ray stop``,
which ends every Ray process on the machine, other clusters' included.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import time
from typing import Callable, Iterable, Iterator, Sequence

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def process_group(cmd: Sequence[str], log_path: pathlib.Path, env: dict[str, str] | None = None,
                  stop: int = signal.SIGTERM, grace_s: float = 30.0) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` in the repository root, in a new process group, stdout and stderr to
    ``log_path``; when the block ends, however it ends, send ``stop`` to the group, wait up to
    ``grace_s`` for ``cmd``, then kill what is left of the group (children that outlived it)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, stop)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def healthy(urls: Iterable[str]) -> bool:
    """Whether every one of ``urls`` answers 200 now."""
    try:
        return all(httpx.get(url, timeout=5).status_code == 200 for url in urls)
    except httpx.HTTPError:
        return False


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float, log_path: pathlib.Path,
               what: str) -> None:
    """Poll ``ready`` until it is true; raise with the end of the log if ``proc`` exits first or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; its log ends:\n{log_path.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready in {timeout_s:.0f} s; its log ends:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.5)
