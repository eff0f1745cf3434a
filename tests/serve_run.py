"""``serve run serve_config.yaml`` in a process group of its own, as a user starts it."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
from typing import Iterable, Iterator

from process_groups import healthy, process_group, wait_ready
from support import wait_until

URL = "http://127.0.0.1:8000"  # serve_config.yaml's http_options
STOP_GRACE_S = 2


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@contextlib.contextmanager
def serve_run(
    log_path: pathlib.Path, config: str = "serve_config.yaml", port: int = 8000, health_urls: Iterable[str] = (f"{URL}/health",),
    *, python: str | None = None, env: dict[str, str] | None = None, timeout_s: float = 180,
) -> Iterator[subprocess.Popen]:
    """Start ``serve run config`` (a path relative to the repository, or absolute; its
    ``http_options`` on ``port``), wait up to ``timeout_s`` until every one of ``health_urls``
    answers 200, yield the process; stop exactly its process group afterwards (never ``ray
    stop``). ``python``: the interpreter of another venv, whose ``serve`` runs instead (with
    ``env``, else this process's environment)."""
    assert port_free(port), f"port {port} ({config}) is taken; stop what uses it"
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != "RAY_ADDRESS"}
    serve_cli = pathlib.Path(python or sys.executable).parent / "serve"
    # Ctrl-C to the group, as a terminal sends it; the graceful drain of every replica that
    # it starts is not waited out for long (it can take a minute): the group is killed next.
    try:
        with process_group([str(serve_cli), "run", config], log_path, env, signal.SIGINT, STOP_GRACE_S) as proc:
            wait_ready(proc, lambda: healthy(health_urls), timeout_s, log_path, "serve run")
            yield proc
    finally:
        wait_until(lambda: port_free(port), 30, what=f"port {port} to be released")


def gcs_address(proc: subprocess.Popen) -> str:
    """The address of the Ray cluster that ``serve run`` (``proc``) started: its raylet, a child
    process, is told it on its command line (``--gcs-address=IP:PORT``)."""
    import psutil

    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            args = child.cmdline()
        except psutil.Error:
            continue
        if args and args[0].endswith("/raylet"):
            return next(arg.split("=", 1)[1] for arg in args if arg.startswith("--gcs-address="))
    raise AssertionError(f"no raylet process under serve run (pid {proc.pid})")
