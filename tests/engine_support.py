"""Pieces of a vLLM engine for the connector tests: a TP worker's encoder-cache side as a Ray
actor, a gate that holds an encode pending until the test opens it, and a registry shard
that does not answer.

``VllmWorkerRank`` is one TP rank: its own process, its worker-role connector built by vLLM's
``ensure_ec_transfer_initialized``, driven with the GPU model runner's
``maybe_get_ec_connector_output`` (``vllm_env.worker_load``). Configs and scheduler outputs
travel pickled, so vLLM is imported in the actor only after ``vllm_env`` chose the CPU platform.
"""

from __future__ import annotations

import asyncio
import hashlib
import pickle
from typing import Any

import ray


@ray.remote(num_cpus=0)
class VllmWorkerRank:
    def __init__(self, config: bytes):
        import vllm_env

        self._env = vllm_env
        vllm_env.worker_connector(pickle.loads(config))
        self.cache: dict[str, Any] = {}

    def load(self, scheduler_output: bytes) -> dict[str, Any]:
        """One step's loads; returns the connector's output (pickled) and what the cache holds."""
        output = self._env.worker_load(pickle.loads(scheduler_output), self.cache)
        return {"output": pickle.dumps(output), "cache": {key: _describe(t) for key, t in self.cache.items()}}

    def clear(self) -> None:
        """Free the encoder cache, as the engine does once the requests that used it finished.
        (Its tensors may view the objects they were fetched in: they hold them until then.)"""
        self.cache.clear()

    def prime(self, identifier: str, tokens: int, width: int) -> None:
        """Put ``identifier`` in this rank's encoder cache, as an earlier step would have."""
        import torch

        self.cache[identifier] = torch.ones(tokens, width, dtype=torch.bfloat16)


def _describe(tensor) -> dict[str, Any]:
    import torch

    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    return {
        "sha256": hashlib.sha256(raw.contiguous().numpy().tobytes()).hexdigest(),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "device": str(tensor.device),
        "all_zero": bool((tensor == 0).all()),
    }


@ray.remote(num_cpus=0)
class Gate:
    """Holds whoever waits on it until ``open``."""

    def __init__(self):
        self._opened = asyncio.Event()

    async def wait(self) -> None:
        await self._opened.wait()

    async def open(self) -> None:
        self._opened.set()


@ray.remote(num_cpus=0)
def gated(gate, value):
    """``value``, once ``gate`` opens: an object the encoder must wait for."""
    ray.get(gate.wait.remote())
    return value


@ray.remote(num_cpus=0)
class SilentRegistry:
    """A registry shard that answers ``ping`` only once ``gate`` opens, as one that is
    restarting would not; after that it has heard of nothing."""

    def __init__(self, gate):
        self._gate = gate

    async def ping(self) -> dict[str, Any]:
        await self._gate.wait.remote()
        return {"shards": 1}

    async def watch(self, known: dict[str, Any], timeout_s: float) -> dict[str, str]:
        return dict.fromkeys(known, "unknown")


@ray.remote(num_cpus=0)
class StuckRegistry:
    """A registry shard that is alive and accepts every call but, past ``ping``, answers none."""

    async def ping(self) -> dict[str, Any]:
        return {"shards": 1}

    async def _never(self, *args: Any) -> None:
        await asyncio.Event().wait()

    watch = fetch_many = acknowledge_many = states = _never
