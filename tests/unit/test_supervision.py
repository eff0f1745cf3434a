"""A supervised background loop that dies is logged with its traceback and started again."""

import asyncio
import logging

from registry import supervision


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
