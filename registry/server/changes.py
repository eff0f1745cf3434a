"""Waiting for an entry to change, without polling.

Every call that waits on the registry (``submit`` with ``wait``, ``describe``, and the
ranks' ``fetch``, ``claim``, ``endpoints`` and ``watch``) registers an ``asyncio.Event``
under each ``req_id`` it waits on; the actor calls ``Changes.changed(req_id)`` after
every change to that entry, which sets them and then runs the actor's own hook (stop
an encode nobody wants, re-arm the expiry timer, mark the gauges stale). A waiter wakes,
reads the state machine again and decides for itself whether to wait more: an event
says only "look again", so a spurious wake-up costs a read, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Iterator

from registry.checks import check_seconds
from registry.errors import InvalidRequest


def check_wait(value: float, name: str, req_id: str | None) -> float:
    """A caller's wait, refused with ``invalid_request`` about ``req_id``."""
    return check_seconds(value, lambda message: InvalidRequest(message, req_id), name)


async def wait_up_to(event: asyncio.Event, timeout: float | None) -> None:
    """Until ``event`` is set or ``timeout`` seconds pass (None: no limit), whichever is first."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        pass


class Changes:
    """The waiters of each ``req_id``; ``on_change(req_id)`` runs after they are woken."""

    def __init__(self, on_change: Callable[[str], None]):
        self._on_change = on_change
        self._wakes: dict[str, set[asyncio.Event]] = {}  # req_id -> the events of the calls waiting on it
        self.waiting_calls = 0  # ``wait`` calls in flight (the ``waiting_calls`` stat; watches not counted)

    def changed(self, req_id: str) -> None:
        """Something about ``req_id`` changed: wake every call waiting on it."""
        for wake in self._wakes.get(req_id, ()):
            wake.set()
        self._on_change(req_id)

    async def wait(self, req_id: str, timeout: float | None) -> None:
        """Until ``req_id`` changes or ``timeout`` seconds pass (None: no limit)."""
        self.waiting_calls += 1
        try:
            with self.watching((req_id,)) as wake:
                await wait_up_to(wake, timeout)
        finally:
            self.waiting_calls -= 1

    @contextlib.contextmanager
    def watching(self, req_ids: Iterable[str]) -> Iterator[asyncio.Event]:
        """One event, set whenever any of ``req_ids`` changes while the block runs: a caller
        that clears it (with no ``await`` between) each time it reads the state misses no change."""
        req_ids = list(req_ids)
        wake = asyncio.Event()
        for req_id in req_ids:
            self._wakes.setdefault(req_id, set()).add(wake)
        try:
            yield wake
        finally:
            for req_id in req_ids:
                wakes = self._wakes.get(req_id)
                if wakes is not None:
                    wakes.discard(wake)
                    if not wakes:
                        del self._wakes[req_id]
