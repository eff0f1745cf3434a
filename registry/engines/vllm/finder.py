"""Finding the registry without ever waiting for it, for callers that must not block.

An engine's scheduler step must not wait on the network: connecting to Ray and asking
shard 0 how many shards there are can take up to ``Shards.lookup``'s 30 s when the
registry is restarting. ``RegistryFinder`` runs that lookup on a thread of its own and
tells the caller, at once, what it knows: the shards, that a lookup is still under way,
or that the last one failed.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from registry.logs import get_logger

logger = get_logger(__name__)


class RegistryFinder:
    """The running registry's ``Shards``, looked up in the background.

    ``shards()`` returns them once found; until then it returns None and starts a lookup
    if none is running (after a failed one, no sooner than ``retry_s`` later). ``failed``
    is True while the last lookup that ended found no registry, or none that answered within
    ``timeout_s``, and while a lookup has been under way for longer than ``timeout_s`` (joining
    a cluster that is not there can hang for minutes: its answer still counts when it comes).
    ``forget()`` drops the shards found (a call to them failed: the registry restarted, is
    gone or is stuck), so the next ``shards()`` looks again.
    """

    def __init__(
        self, name: str, namespace: str, ray_address: str = "auto", retry_s: float = 1.0, *, owner: str = "",
        timeout_s: float = 30.0,
    ) -> None:
        self._name, self._namespace, self._address = name, namespace, ray_address
        self._retry_s = retry_s
        self._timeout_s = timeout_s  # how long shard 0 may take to answer a lookup
        self._owner = owner  # who looks, for the log line
        self._shards: Any = None
        self._thread: threading.Thread | None = None
        self._result: Any = None
        self._next_try = 0.0
        self._started = 0.0  # when the lookup under way started
        self.failed = False

    def shards(self) -> Any:
        if self._shards is not None:
            return self._shards
        if self._thread is not None and not self._thread.is_alive():
            self._thread, result = None, self._result
            if isinstance(result, BaseException):
                self.failed = True
                logger.warning("%s%s; looking again in %g s", self._owner, result, self._retry_s)
            else:
                self._shards, self.failed = result, False
        if self._shards is None and self._thread is None and time.monotonic() >= self._next_try:
            self._started = time.monotonic()
            self._next_try = self._started + self._retry_s
            self._thread = threading.Thread(target=self._look, name="epd-registry-lookup", daemon=True)
            self._thread.start()
        elif self._thread is not None and not self.failed and time.monotonic() - self._started > self._timeout_s:
            self.failed = True
            logger.warning("%slooking the registry up has taken over %g s; going on without it meanwhile",
                           self._owner, self._timeout_s)
        return self._shards

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the lookup under way to end (or, after a failed one,
        for the time of the next); True if a lookup ended."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        time.sleep(max(0.0, min(timeout_s, self._next_try - time.monotonic())))
        return False

    def forget(self) -> None:
        self._shards = None

    def _look(self) -> None:
        import ray

        from registry.errors import Unavailable
        from registry.client.shards import Shards

        try:
            if not ray.is_initialized():
                # The cluster's logs are not the engine's to print.
                ray.init(address=cluster_address(self._address), log_to_driver=False)
            self._result = Shards.lookup(self._name, self._namespace, timeout_s=self._timeout_s)
        except (Unavailable, ConnectionError) as exc:
            self._result = exc
        except Exception as exc:  # noqa: BLE001 - whatever it is, the caller goes on without a registry
            self._result = Unavailable(f"looking the registry up failed ({type(exc).__name__}: {exc})")


def cluster_address(address: str) -> str:
    """Where ``ray.init`` connects a process without Ray for the configured ``address``.

    ``"auto"`` in a process that a Ray worker started (vLLM's engine core and ``mp``
    workers under Ray Serve LLM: they inherit the worker's ``RAY_RAYLET_PID``) is that
    worker's cluster, the raylet's ``--gcs-address``. Ray's own ``"auto"`` takes the
    cluster ``ray start`` recorded last, else any GCS process on the host: on a host
    running several clusters (one ``serve run`` each), not necessarily the one that
    runs this engine. ``RAY_ADDRESS``, when set, wins as it does in ``ray.init``.
    """
    if address != "auto" or os.environ.get("RAY_ADDRESS"):
        return address
    raylet_pid = os.environ.get("RAY_RAYLET_PID", "")
    try:
        with open(f"/proc/{int(raylet_pid)}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except (ValueError, OSError):  # not under a Ray worker, or not Linux
        return address
    return next((arg.split("=", 1)[1] for arg in args if arg.startswith("--gcs-address=")), address)
