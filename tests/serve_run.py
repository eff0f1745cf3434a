"""``serve run serve_config.yaml`` in a process group of its own, as a user starts it."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
from typing import Iterator

import httpx

from support import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[1]
URL = "http://127.0.0.1:8000"  # serve_config.yaml's http_options


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def healthy() -> bool:
    try:
        return httpx.get(f"{URL}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def serve_run(log_path: pathlib.Path) -> Iterator[subprocess.Popen]:
    """Start it, wait until ``/health`` answers 200, yield the process; stop exactly its
    process group afterwards (never ``ray stop``)."""
    assert port_free(8000), "port 8000 (serve_config.yaml) is taken; stop what uses it"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    serve_cli = pathlib.Path(sys.executable).parent / "serve"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(serve_cli), "run", "serve_config.yaml"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        try:
            wait_until(lambda: proc.poll() is not None or healthy(), 120, interval_s=0.5, what="a healthy service")
        except AssertionError:
            raise AssertionError("serve run did not become healthy; its log ends:\n" + log_path.read_text()[-4000:]) from None
        assert proc.poll() is None, log_path.read_text()[-4000:]
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the cluster serve run started
        except ProcessLookupError:
            pass
        wait_until(lambda: port_free(8000), 30, what="port 8000 to be released")
