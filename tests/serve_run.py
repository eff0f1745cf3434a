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

import httpx

from support import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[1]
URL = "http://127.0.0.1:8000"  # serve_config.yaml's http_options
STOP_GRACE_S = 2


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def healthy(health_urls: Iterable[str] = (f"{URL}/health",)) -> bool:
    try:
        return all(httpx.get(url, timeout=5).status_code == 200 for url in health_urls)
    except httpx.HTTPError:
        return False


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
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(serve_cli), "run", config], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        try:
            wait_until(lambda: proc.poll() is not None or healthy(health_urls), timeout_s, interval_s=0.5,
                       what="a healthy service")
        except AssertionError:
            raise AssertionError("serve run did not become healthy; its log ends:\n" + log_path.read_text()[-4000:]) from None
        assert proc.poll() is None, log_path.read_text()[-4000:]
        yield proc
    finally:
        # Ctrl-C, as a user stops it; its graceful drain of every replica is not waited out
        # for long (it can take a minute), since the process group goes next.
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the cluster serve run started
        except ProcessLookupError:
            pass
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
