"""A supervised background loop that dies is logged with its traceback and started again; a
gather whose caller left leaves nothing for asyncio to log."""

import asyncio
import gc
import logging

import pytest

from registry import supervision
from registry.supervision import gather_within


def test_a_loop_that_dies_is_logged_and_restarted(caplog, monkeypatch):
    monkeypatch.setattr(supervision, "RESTART_DELAY_S", 0.01)
    logger = logging.getLogger("test.supervision")
    runs = []

    async def loop():
        runs.append(len(runs))
        if len(runs) == 1:
            raise KeyError("a bug on the first run")
        await asyncio.sleep(3600)

    async def scenario():
        tasks = []

        def start():
            tasks.append(supervision.supervised(loop(), "the test loop", start, logger))

        start()
        for _ in range(200):
            if len(runs) == 2:
                break
            await asyncio.sleep(0.01)
        tasks[-1].cancel()  # a cancelled loop is not restarted
        await asyncio.sleep(0.05)
        return len(tasks)

    with caplog.at_level(logging.ERROR, logger="test.supervision"):
        started = asyncio.run(scenario())
    assert runs == [0, 1] and started == 2
    [record] = caplog.records
    assert "the test loop died" in record.getMessage() and record.exc_info[0] is KeyError


def _plain(timeout_s, *awaitables):
    return asyncio.wait_for(asyncio.gather(*awaitables), timeout_s)


@pytest.mark.parametrize("gather, logged", [(_plain, True), (gather_within, False)], ids=["wait_for-gather", "gather_within"])
def test_a_caller_that_leaves_leaves_no_traceback_for_asyncio_to_log(caplog, gather, logged):
    """An HTTP client leaving cancels the handler; the gather it waited on must not end as an
    error that nobody read (asyncio logs those with a traceback when they are collected)."""

    async def scenario():
        waiting = asyncio.ensure_future(gather(5.0, asyncio.sleep(10), asyncio.sleep(10)))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(scenario())
        gc.collect()
    assert any("never retrieved" in r.getMessage() for r in caplog.records) is logged


def test_gather_within_answers_in_order_and_raises_the_first_error_or_a_timeout():
    async def value(v, delay):
        await asyncio.sleep(delay)
        return v

    async def fail():
        raise ValueError("bad")

    assert asyncio.run(gather_within(5.0, value("a", 0.02), value("b", 0))) == ["a", "b"]
    with pytest.raises(ValueError, match="bad"):
        asyncio.run(gather_within(5.0, value("a", 0), fail()))
    with pytest.raises(TimeoutError):
        asyncio.run(gather_within(0.01, value("a", 5)))
