"""``EncoderClient``'s sharing of an item's encode among its waiters, in one event loop (no
Ray): the Encoder deployment is stood in for by calls the test releases by hand."""

import asyncio

from deployments.config import AppConfig
from encoder import EncodedItem, PreparedItem
from registry.server.encodes import EncoderClient
from registry.server.inputs import MediaInput

import torch


class HeldCalls:
    """Stands in for ``registry.server.batched_calls.EncoderCalls``: each encode waits for ``release``."""

    def __init__(self):
        self.started = 0
        self.release = asyncio.Event()

    async def encode(self, key, payload, req_id):
        self.started += 1
        await self.release.wait()
        item = EncodedItem.from_tensor(torch.zeros(2, 4), PreparedItem(torch.empty(0), key, {}, ()))
        return f"ref-{self.started}", item

    def stats(self):
        return {}


async def _client():
    settings = AppConfig(cache_max_bytes=0).registry_settings(encoder_app="epd")
    client = EncoderClient(settings)
    client._calls = HeldCalls()
    identity = asyncio.get_running_loop().create_future()
    identity.set_result("model-id")
    client._identity = identity
    return client


async def _until(condition, turns=10_000):
    """Let the loop turn until ``condition`` holds (a count of turns, not a time: no sleeps)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not reached in {turns} event-loop turns")


def test_a_request_that_joins_an_encode_being_cancelled_gets_a_fresh_encode():
    async def scenario():
        client = await _client()
        item = MediaInput("digest-1", data=b"image bytes")
        first = asyncio.create_task(client.encode("a", 0, item))
        await _until(lambda: client._calls.started == 1)
        shared = next(iter(client._inflight.values()))
        first.cancel()  # its last waiter leaves: the shared encode is being cancelled ...
        await _until(lambda: shared.task.cancelling())
        # ... and before it has ended, the same image arrives again.
        second = asyncio.create_task(client.encode("b", 0, item))
        await _until(lambda: client._calls.started == 2)
        client._calls.release.set()
        staged = await asyncio.wait_for(second, 5)
        assert staged.ref == "ref-2" and first.cancelled()
        assert client._inflight == {}

    asyncio.run(scenario())


def test_waiters_share_one_encode_and_a_leaving_waiter_does_not_stop_it():
    async def scenario():
        client = await _client()
        item = MediaInput("digest-2", data=b"image bytes")
        tasks = [asyncio.create_task(client.encode(r, 0, item)) for r in ("a", "b", "c")]
        await _until(lambda: client._calls.started == 1)
        tasks[0].cancel()
        client._calls.release.set()
        staged = await asyncio.gather(*tasks[1:])
        assert [s.ref for s in staged] == ["ref-1", "ref-1"] and client._calls.started == 1
        assert client.joined == 2

    asyncio.run(scenario())
