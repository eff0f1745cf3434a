"""Background loops of a long-lived process that cannot die silently.

A loop started with ``supervised`` that ever ends with an error is logged with its
traceback and, after ``RESTART_DELAY_S`` (not at once: a loop that keeps failing
must not spin), ``restart`` is called to start it again. A silent ``asyncio.Task``
death is an outage no test sees: the registry's expiry timer stopping would leave
every entry, and every caller waiting on one, to hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

RESTART_DELAY_S = 1.0


def supervised(loop: Coroutine[Any, Any, Any], name: str, restart: Callable[[], None], logger: logging.Logger) -> asyncio.Task:
    """``loop`` as a task; if it dies (not cancelled), ``restart`` runs ``RESTART_DELAY_S`` later."""
    task = asyncio.create_task(loop)

    def done(task: asyncio.Task) -> None:
        if task.cancelled():
            return
        logger.error("%s died; restarting it in %.0f s", name, RESTART_DELAY_S, exc_info=task.exception())
        asyncio.get_running_loop().call_later(RESTART_DELAY_S, restart)

    task.add_done_callback(done)
    return task
