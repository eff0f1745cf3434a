"""A benchmark window on a slow machine measures a lower rate; it never comes back empty."""

import asyncio

from benchmarks.end_to_end import _MIN_SAMPLES_PER_SLOT, _closed_loop


def test_a_window_shorter_than_one_request_stays_open_until_it_has_its_samples():
    async def slow_send(_body):
        await asyncio.sleep(0.2)  # each request takes twice the window

    latencies, issued, window_s = asyncio.run(_closed_loop(slow_send, [None], 2, warmup_s=0.0, window_s=0.1))
    assert len(latencies) >= _MIN_SAMPLES_PER_SLOT * 2
    assert issued >= len(latencies)
    assert window_s >= 0.2 * _MIN_SAMPLES_PER_SLOT * 0.9  # the rate divides by how long it really lasted
    assert all(0.15 < latency < 1.0 for latency in latencies)


def test_a_fast_window_closes_on_time():
    async def fast_send(_body):
        await asyncio.sleep(0.001)

    latencies, _, window_s = asyncio.run(_closed_loop(fast_send, [None], 2, warmup_s=0.05, window_s=0.2))
    assert len(latencies) > 20
    assert 0.2 <= window_s < 0.5
