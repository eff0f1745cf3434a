"""The actors that take measurements from the decoder's side of the service.

* ``RankProbe``: one TP rank's process. It fetches through the real
  ``EmbeddingReceiver`` (one request timed, or many at a time for the registry's
  throughput) and, in the same process, times the baselines the fetch is judged
  against: one round trip to a no-op async actor, a memcpy of the same bytes,
  and the ZMQ transfer of the same bytes.
* ``Peer``: an async actor whose ``ping`` does nothing, for the round trip and
  the raw pipelined call rate; a thread of it is the SGLang-style baseline's
  sending side: per rank, a PULL socket takes a request ("send me N bytes") and
  a PUSH socket answers with the bytes, sent zero-copy from a ready numpy buffer
  (no pickling: the most favourable form of the baseline).

Timers run inside the process that does the work (``time.perf_counter``), so
Ray's own reply to the driver is not part of any sample.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import mmap
import os
import threading
import time
import warnings
from typing import Any, Awaitable, Callable

import numpy as np
import ray
import zmq


def in_shared_memory(address: int) -> bool:
    """Whether ``address`` lies in a shared-memory mapping (the object store) of this process.

    A zero-copy read leaves the tensor's data in Ray's /dev/shm-backed store mapping;
    a copy would put it in private anonymous memory.
    """
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                path = fields[5] if len(fields) > 5 else ""
                return "/dev/shm" in path or "plasma" in path
    return False


def fresh_copy(src: np.ndarray) -> None:
    """memcpy ``src`` into pages never touched before (a new anonymous mapping), so the
    copy also pays the first-touch page faults. (``src.copy()`` would not: the allocator
    hands back the pages of the last freed buffer of that size.)"""
    with mmap.mmap(-1, src.nbytes) as buf:
        np.frombuffer(buf, dtype=np.uint8)[:] = src.reshape(-1).view(np.uint8)


async def pipelined(call: Callable[[], Awaitable], total: int, concurrency: int) -> float:
    """Run ``total`` calls, ``concurrency`` at a time; return calls per second."""
    issued = itertools.count()

    async def worker() -> None:
        while next(issued) < total:
            await call()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - start)


@ray.remote(num_cpus=0)
class Peer:
    """The no-op async actor, which also runs the ZMQ baseline's sending side in a thread.

    One process for both keeps the number of processes the run starts down; the ZMQ
    thread sleeps in ``poll`` except while it sends, so the round trips measured
    against ``ping`` do not wait for it.
    """

    def __init__(self, sizes: list[int], ranks: int):
        self._payloads = {n: np.random.default_rng(n).integers(-(2**15), 2**15, n // 2, dtype=np.int16) for n in sizes}
        self._ctx = zmq.Context()
        self._pairs = [(self._ctx.socket(zmq.PULL), self._ctx.socket(zmq.PUSH)) for _ in range(ranks)]
        self._endpoints = [
            (requests.bind_to_random_port("tcp://127.0.0.1"), data.bind_to_random_port("tcp://127.0.0.1"))
            for requests, data in self._pairs
        ]
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    async def ping(self) -> None:
        return None

    async def serve_calls_per_s(self, app: str, deployment: str, total: int, concurrency: int) -> float:
        """The pipelined rate of no-op Serve handle calls (``identity``) made from this actor's
        event loop, as the registry makes its calls to the encoder."""
        from ray import serve

        handle = await asyncio.to_thread(serve.get_deployment_handle, deployment, app)
        await asyncio.gather(*(handle.identity.remote() for _ in range(concurrency)))  # warm-up
        return await pipelined(lambda: handle.identity.remote(), total, concurrency)

    async def pid(self) -> int:
        return os.getpid()

    async def endpoints(self) -> list[tuple[int, int]]:
        """(request port, data port) per rank, on 127.0.0.1."""
        return self._endpoints

    def _serve(self) -> None:
        poller = zmq.Poller()
        for requests, _ in self._pairs:
            poller.register(requests, zmq.POLLIN)
        while not self._stop.is_set():
            for socket, _ in poller.poll(100):
                nbytes = int(socket.recv())
                data = next(d for r, d in self._pairs if r is socket)
                data.send(self._payloads[nbytes], copy=False)

    async def stop(self) -> None:
        self._stop.set()


@ray.remote(num_cpus=0)
class RankProbe:
    def __init__(self, rank: int, sizes: list[int]):
        # torch now, not inside the first timed fetch (the module leaves it out for Peer's sake).
        import torch  # noqa: F401

        self.rank = rank
        self._receiver: Any = None
        self._src = {n: np.ones(n, dtype=np.uint8) for n in sizes}
        self._dst = {n: np.ones(n, dtype=np.uint8) for n in sizes}
        self._zmq: tuple[Any, Any] | None = None

    def pid(self) -> int:
        return os.getpid()

    def use_registry(self, name: str, namespace: str) -> None:
        """Fetch from this registry from now on (each section has its own)."""
        from registry import EmbeddingReceiver

        self._receiver = EmbeddingReceiver(self.rank, registry_name=name, registry_namespace=namespace)

    def fetch(self, req_id: str) -> dict[str, Any]:
        """Time ``EmbeddingReceiver.fetch`` to a usable tensor; check dtype and zero-copy."""
        import torch

        start = time.perf_counter()
        items = self._receiver.fetch(req_id, timeout_s=60.0)
        tensor = items[0].tensor
        elapsed = time.perf_counter() - start
        return {
            "s": elapsed,
            "bf16": tensor.dtype == torch.bfloat16,
            "zero_copy": in_shared_memory(tensor.data_ptr()),
            "nbytes": tensor.numel() * tensor.element_size(),
        }

    def fetch_many(self, req_ids: list[str], concurrency: int, timeout_s: float = 30.0) -> dict[str, int]:
        """Fetch every one of ``req_ids`` (``concurrency`` at a time, as a rank's engine would
        for requests in flight) and drop the items; count the failures by type.

        ``fetch_async`` awaits the object without a deadline, so each fetch gets one here:
        a lost object must show up as a counted error, not stall the benchmark.
        """

        async def main() -> dict[str, int]:
            errors: dict[str, int] = {}
            pending = iter(req_ids)

            async def worker() -> None:
                for req_id in pending:
                    try:
                        await asyncio.wait_for(self._receiver.fetch_async(req_id, timeout_s=timeout_s), timeout_s + 5)
                    except Exception as exc:  # noqa: BLE001 - counted and reported
                        errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return errors

        return asyncio.run(main())

    def rtt(self, actor: Any, n: int) -> list[float]:
        """``n`` round trips to the no-op async actor, one at a time."""
        out = []
        for _ in range(n):
            start = time.perf_counter()
            ray.get(actor.ping.remote())
            out.append(time.perf_counter() - start)
        return out

    def memcpy(self, nbytes: int, n: int) -> dict[str, list[float]]:
        """``n`` memcpys of ``nbytes`` into a warm buffer, and ``n`` into fresh pages."""
        src, dst = self._src[nbytes], self._dst[nbytes]
        warm, fresh = [], []
        for _ in range(n):
            start = time.perf_counter()
            np.copyto(dst, src)
            warm.append(time.perf_counter() - start)
            start = time.perf_counter()
            fresh_copy(src)
            fresh.append(time.perf_counter() - start)
        return {"warm": warm, "fresh": fresh}

    def connect_zmq(self, request_port: int, data_port: int) -> None:
        ctx = zmq.Context.instance()
        requests, data = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        requests.connect(f"tcp://127.0.0.1:{request_port}")
        data.connect(f"tcp://127.0.0.1:{data_port}")
        self._zmq = (requests, data)

    def zmq_fetch(self, nbytes: int) -> dict[str, Any]:
        """Ask for ``nbytes`` over ZMQ and time until they are a bfloat16 tensor."""
        import torch

        assert self._zmq is not None, "connect_zmq first"
        requests, data = self._zmq
        start = time.perf_counter()
        requests.send(str(nbytes).encode())
        frame = data.recv(copy=False)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            tensor = torch.frombuffer(frame.buffer, dtype=torch.bfloat16)  # a view of ZMQ's message
        elapsed = time.perf_counter() - start
        return {"s": elapsed, "nbytes": tensor.numel() * 2, "bf16": tensor.dtype == torch.bfloat16}


@dataclasses.dataclass
class Probes:
    """The measuring actors, started once, beside the apps' deployment, and shared by the sections."""

    ranks: list[Any]
    noop: Any  # a Peer: the no-op async actor and the ZMQ sender

    @classmethod
    def start(cls, ranks: int, sizes: list[int]) -> "Probes":
        return cls(ranks=[RankProbe.remote(r, sizes) for r in range(ranks)], noop=Peer.remote(sizes, ranks))

    def ready(self) -> None:
        """Wait until every actor is up and the ranks are connected to the ZMQ sender."""
        endpoints = ray.get(self.noop.endpoints.remote())
        ray.get([rank.connect_zmq.remote(*endpoints[i]) for i, rank in enumerate(self.ranks)])
