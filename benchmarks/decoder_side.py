"""The decoder's side: the actors that measure from it, ``Rank`` (one TP rank's process) and ``Peer``,
and the ``fetch`` section.

``Rank`` fetches through the real ``EmbeddingReceiver`` and times, in the same process and
event loop, the baselines a fetch is judged against: a round trip to ``Peer``'s no-op method,
a warm memcpy of the same bytes, and the same bytes over ZMQ PUSH/PULL from ``Peer``'s sender
thread (no pickling, no copy: the most favourable form of SGLang's way). Timers run in the
process that does the work, so no sample holds a reply to the driver.

``fetch``: per size and round, three items are staged (``receive_count`` 1) and received one
at a time on an otherwise quiet cluster: by a rank's ``fetch_async`` (checked to be bf16 and a
view of the store), and from this process by ``ZmqEmbeddingReceiver`` and by the HTTP pull
(``safetensors.torch.load`` of the body); beside them in the same round, the rank's round
trip, memcpy and raw ZMQ, one HTTP call through Serve's proxy and the Ingress, and the
Ingress's CPU per MB. Interleaved after two warm-up rounds, so every baseline is measured
where it is the limit, never beside the benchmark's own load.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
import warnings
from typing import Any, Awaitable, Callable

import httpx
import numpy as np
import ray
import zmq

from benchmarks.cluster import CpuMeter
from benchmarks.report import size_label
from benchmarks.runner import SIZES, Context

SECTION = "fetch"
_WARM_ROUNDS = 2
_TIMES = ("fetch", "round_trip", "memcpy", "zmq_baseline", "zmq_fetch", "http_pull", "http_round_trip")


async def pipelined(call: Callable[[], Awaitable[Any]], total: int, concurrency: int) -> float:
    """Run ``total`` calls, ``concurrency`` at a time; return calls per second."""
    issued = itertools.count()

    async def worker() -> None:
        while next(issued) < total:
            await call()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - start)


def in_shared_memory(address: int) -> bool:
    """Whether ``address`` lies in a shared-memory mapping of this process: a zero-copy read
    leaves a tensor's data in Ray's /dev/shm-backed store mapping, a copy in private memory."""
    with open("/proc/self/maps") as maps:
        spans = [(line, *(int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))) for line in maps]
    return any(start <= address < end and ("/dev/shm" in line or "plasma" in line) for line, start, end in spans)


@ray.remote(num_cpus=0)
class Peer:
    """The no-op async actor, which also runs the ZMQ baseline's sending side, for one rank at a
    time, in a thread (one process for both keeps the run's process count down; the thread
    waits in ``recv`` except while it sends, so the round trips to ``ping`` do not wait for it)."""

    def __init__(self, sizes: list[int]):
        self._payloads = {n: np.random.default_rng(n).integers(-(2**15), 2**15, n // 2, dtype=np.int16) for n in sizes}
        self._requests, self._data = zmq.Context.instance().socket(zmq.PULL), zmq.Context.instance().socket(zmq.PUSH)
        self._ports = [socket.bind_to_random_port("tcp://127.0.0.1") for socket in (self._requests, self._data)]
        threading.Thread(target=self._serve, daemon=True).start()

    async def ping(self) -> None:
        return None

    async def pid(self) -> int:
        return os.getpid()

    async def ports(self) -> list[int]:
        """The request and the data port, on 127.0.0.1."""
        return self._ports

    async def serve_calls_per_s(self, app: str, deployment: str, total: int, concurrency: int) -> float:
        """The pipelined rate of no-op Serve handle calls (``identity``) made from this actor's
        event loop, as the registry makes its calls to the encoder."""
        from ray import serve

        handle = await asyncio.to_thread(serve.get_deployment_handle, deployment, app)
        await asyncio.gather(*(handle.identity.remote() for _ in range(concurrency)))  # warm-up
        return await pipelined(lambda: handle.identity.remote(), total, concurrency)

    def _serve(self) -> None:
        while True:
            self._data.send(self._payloads[int(self._requests.recv())], copy=False)


@ray.remote(num_cpus=0)
class Rank:
    """One TP rank's process; its baselines' far side is ``peer`` (a ``Peer``)."""

    def __init__(self, rank: int, sizes: list[int], peer: Any):
        import torch  # now, not inside the first timed fetch

        self._torch, self.rank, self._peer = torch, rank, peer
        self._receivers: dict[str, Any] = {}
        self._receiver: Any = None
        self._buffers = {n: (np.ones(n, np.uint8), np.ones(n, np.uint8)) for n in sizes}
        self._zmq: tuple[Any, Any] | None = None

    async def pid(self) -> int:
        return os.getpid()

    async def use_registry(self, name: str, namespace: str) -> None:
        """Fetch from this registry from now on (a receiver per registry, so switching back costs no lookup)."""
        from registry import EmbeddingReceiver

        if name not in self._receivers:
            self._receivers[name] = EmbeddingReceiver(self.rank, registry_name=name, registry_namespace=namespace)
        self._receiver = self._receivers[name]

    async def fetch(self, req_id: str) -> tuple[float, bool]:
        """Seconds for ``fetch_async`` to a usable tensor, and whether it is bf16 and a view of the store."""
        start = time.perf_counter()
        tensor = (await self._receiver.fetch_async(req_id, timeout_s=60.0))[0].tensor
        elapsed = time.perf_counter() - start
        return elapsed, tensor.dtype == self._torch.bfloat16 and in_shared_memory(tensor.data_ptr())

    async def fetch_all(self, req_ids: list[str], concurrency: int) -> int:
        """Fetch each of ``req_ids``, ``concurrency`` at a time, dropping the items; the number that failed."""
        failed, pending = 0, iter(req_ids)

        async def one() -> None:
            nonlocal failed
            try:
                await self._receiver.fetch_async(next(pending), timeout_s=60.0)
            except Exception:  # noqa: BLE001 - counted
                failed += 1

        await pipelined(one, len(req_ids), concurrency)
        return failed

    async def fetch_batch(self, req_ids: list[str], many: bool) -> float:
        """Seconds to fetch ``req_ids`` with one ``fetch_many`` or with as many ``fetch_async`` in flight."""
        start = time.perf_counter()
        if many:
            out = await self._receiver.fetch_many_async(req_ids, timeout_s=60.0)
            if not all(isinstance(items, list) for items in out.values()):
                raise RuntimeError(f"fetch_many failed: {out}")
        else:
            await asyncio.gather(*(self._receiver.fetch_async(r, timeout_s=60.0) for r in req_ids))
        return time.perf_counter() - start

    async def round_trip(self) -> float:
        start = time.perf_counter()
        await self._peer.ping.remote()
        return time.perf_counter() - start

    async def memcpy(self, nbytes: int) -> float:
        src, dst = self._buffers[nbytes]
        start = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - start

    async def zmq_baseline(self, nbytes: int) -> float:
        """Seconds to ask ``Peer`` for ``nbytes`` over ZMQ and view them as a bf16 tensor."""
        if self._zmq is None:  # connected on first use, once Peer has bound its ports
            self._zmq = (zmq.Context.instance().socket(zmq.PUSH), zmq.Context.instance().socket(zmq.PULL))
            for socket, port in zip(self._zmq, await self._peer.ports.remote(), strict=True):
                socket.connect(f"tcp://127.0.0.1:{port}")
        requests, data = self._zmq
        start = time.perf_counter()
        requests.send(str(nbytes).encode())
        frame = data.recv(copy=False)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            tensor = self._torch.frombuffer(frame.buffer, dtype=self._torch.bfloat16)  # a view of ZMQ's message
        elapsed = time.perf_counter() - start
        if tensor.numel() * 2 != nbytes:
            raise RuntimeError(f"expected {nbytes} bytes over ZMQ, got {tensor.numel() * 2}")
        return elapsed


def start(count: int, sizes: list[int]) -> tuple[Any, list[Any]]:
    """A ``Peer`` and ``count`` ranks; their processes start while the caller goes on."""
    peer = Peer.remote(sizes)
    return peer, [Rank.remote(r, sizes, peer) for r in range(count)]


def _timed(call: Callable[[], Any], ingress: str) -> tuple[float, float]:
    """(seconds ``call`` took, CPU seconds the process titled ``ingress`` spent meanwhile)."""
    with CpuMeter({ingress: "ingress"}) as cpu:
        start = time.perf_counter()
        call()
        elapsed = time.perf_counter() - start
    return elapsed, cpu.by_role.get("ingress", 0.0)


def _round(ctx: Context, rx: Any, http: httpx.Client, ingress: str, nbytes: int) -> dict[str, Any]:
    import safetensors.torch

    rank = ctx.ranks[0]
    ray_id, zmq_id, http_id = (ctx.app.submit(nbytes, receive_count=1)[0] for _ in range(3))
    out: dict[str, Any] = {}
    out["fetch"], out["ok"] = ray.get(rank.fetch.remote(ray_id))
    out["round_trip"] = ray.get(rank.round_trip.remote())
    out["memcpy"] = ray.get(rank.memcpy.remote(nbytes))
    out["zmq_baseline"] = ray.get(rank.zmq_baseline.remote(nbytes))
    out["zmq_fetch"], out["zmq_cpu"] = _timed(lambda: rx.fetch(zmq_id, timeout_s=60.0)[0].tensor, ingress)

    def pull() -> None:
        answer = http.get(f"/v1/requests/{http_id}/items", params={"rank": 0, "timeout_s": 60})
        safetensors.torch.load(answer.raise_for_status().content)["item_0"].numel()

    out["http_pull"], out["http_cpu"] = _timed(pull, ingress)
    out["http_round_trip"], _ = _timed(lambda: http.post(f"/v1/requests/{http_id}/acknowledge", json={"rank": 0}).raise_for_status(), ingress)
    return out


def run(ctx: Context) -> None:
    # Imported here, not above: the actors' processes import this module, and Peer needs no torch.
    from benchmarks import standin
    from registry import ZmqEmbeddingReceiver

    ray.get(ctx.ranks[0].use_registry.remote(ctx.app.registry_name, ctx.namespace))
    url, ingress = f"{ctx.http_url}/{standin.APP}", f"ServeReplica:{standin.APP}:Ingress"
    with ZmqEmbeddingReceiver(rank=0, url=url) as rx, httpx.Client(base_url=url, timeout=120) as http:
        for nbytes in SIZES:
            rounds = [_round(ctx, rx, http, ingress, nbytes) for _ in range(_WARM_ROUNDS + ctx.plan.fetch_rounds)]
            _record(ctx, nbytes, rounds[_WARM_ROUNDS:])
            ctx.step(f"fetch: {size_label(nbytes)} MB")


def _record(ctx: Context, nbytes: int, rounds: list[dict[str, Any]]) -> None:
    results, size = ctx.results, {"size_mb": size_label(nbytes)}
    p50 = {name: results.add(SECTION, f"{name}_s", samples=[r[name] for r in rounds], **size) for name in _TIMES}
    for path in ("zmq", "http"):
        cpu = sum(r[f"{path}_cpu"] for r in rounds) / (len(rounds) * nbytes / 1e6)
        results.add(SECTION, "ingress_cpu_s_per_mb", cpu, "s/MB", n=len(rounds), path=path, **size)
    vs_floor = results.ratio(SECTION, "fetch_vs_round_trip_plus_memcpy", p50["fetch"],
                             p50["round_trip"] + p50["memcpy"], **size)
    vs_zmq = results.ratio(SECTION, "fetch_vs_zmq_baseline", p50["fetch"], p50["zmq_baseline"], **size)
    results.target(SECTION, "fetch_vs_round_trip_plus_memcpy", vs_floor, "<=", 1.5,
                   "p50 fetch <= 1.5 x (one actor round trip + one memcpy), quiet and interleaved", **size)
    if nbytes >= 4_700_000:
        results.target(SECTION, "fetch_vs_zmq_baseline", vs_zmq, "<", 1.0,
                       "p50 fetch faster than ZMQ PUSH/PULL at 4.7 MB and above", **size)
    results.target(SECTION, "bf16_zero_copy", float(all(r["ok"] for r in rounds)), "==", 1.0,
                   "every fetched tensor is bfloat16 and a view of the object store (no copy)", **size)
