"""Background loops of a long-lived process that cannot die silently.

A loop started with ``supervised`` that ever ends with an error is logged with its
traceback and, after ``RESTART_DELAY_S`` (not at once: a loop that keeps failing
must not spin), ``restart`` is called to start it again. A silent ``asyncio.Task``
death is an outage no test sees: the registry's expiry timer stopping would leave
every entry, and every caller waiting on one, to hang.

``gather_within`` is ``asyncio.wait_for(asyncio.gather(...))`` whose outcome is always
retrieved: in Python 3.11, when the caller is cancelled (an HTTP client that leaves), the
gather ends with an error nobody reads, and asyncio logs it with a traceback, an alarm
for what is a client's ordinary choice.
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


async def gather_within(timeout_s: float, *awaitables: Any) -> list[Any]:
    """Every awaitable's result, in order, within ``timeout_s`` (else ``TimeoutError``); the
    first error raises, as with ``asyncio.gather``."""
    gathered = asyncio.gather(*awaitables)
    gathered.add_done_callback(_retrieve)
    return await asyncio.wait_for(gathered, timeout_s)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # read: asyncio then does not log it as never retrieved
