"""Which registry actor holds a req_id, and a client that sends each call to it.

With ``registry_shards: N`` the registry is N detached actors with the same rules,
each holding the entries of its own req_ids: shard 0 under the registry's name,
shard ``i > 0`` under ``"{name}.{i}"``. A req_id belongs to shard
``crc32(utf-8 of req_id) % N``, a hash every client computes the same way, in any
language, with nothing to ask first except N, which shard 0 answers (``ping``).

Nothing about one entry involves two shards, so each shard keeps the lifecycle of
``registry.server.state`` exactly, and a shard that dies loses only its own entries.
What spans shards is summed by the caller: ``stats``, and the admission limits,
which each shard applies to its even share (``RegistrySettings.for_shard``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import ray

from registry.errors import Unavailable
from registry.routing import shard_name, shard_of
from registry.settings import RegistrySettings, registry_address


class Shards:
    """The handles of every shard of one registry, and the routing of a req_id to its own.

    ``Shards.lookup(name, namespace)`` finds a running registry (blocking: it asks the
    GCS and shard 0); the Ingress builds one from the actors it created.
    """

    def __init__(
        self, name: str, namespace: str, handles: list[ray.actor.ActorHandle], settings: RegistrySettings | None = None
    ):
        self.name = name
        self.namespace = namespace
        self.handles = handles
        # The app-wide settings they run with, where this process created them.
        self.settings = settings

    def __len__(self) -> int:
        return len(self.handles)

    def index(self, req_id: str) -> int:
        return shard_of(req_id, len(self.handles))

    def of(self, req_id: str) -> ray.actor.ActorHandle:
        """The handle of the shard that holds ``req_id``."""
        return self.handles[self.index(req_id)]

    def group(self, req_ids: Iterable[str]) -> dict[int, list[str]]:
        """``req_ids`` by the shard that holds them, in their order."""
        groups: dict[int, list[str]] = {}
        for req_id in req_ids:
            groups.setdefault(self.index(req_id), []).append(req_id)
        return groups

    def states(self, req_ids: list[str]) -> dict[str, str]:
        """Each req_id's state (as the registry's ``states``), one call per shard involved
        (blocking)."""
        groups = self.group(req_ids)
        merged: dict[str, str] = {}
        for answer in ray.get([self.handles[i].states.remote(ids) for i, ids in groups.items()]):
            merged.update(answer)
        return {req_id: merged[req_id] for req_id in req_ids}

    @classmethod
    def lookup(cls, name: str | None = None, namespace: str | None = None, *, timeout_s: float = 30.0) -> Shards:
        """Every shard of the running registry (blocking); ``Unavailable`` if one is missing,
        or if shard 0 does not say within ``timeout_s`` how many there are."""
        name, namespace = registry_address(name, namespace)
        first = find_actor(name, namespace)
        try:
            count = ray.get(first.ping.remote(), timeout=timeout_s).get("shards", 1)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise _silent(name, exc) from None
        return cls(name, namespace, [first] + [find_actor(shard_name(name, i), namespace) for i in range(1, count)])

    @classmethod
    async def lookup_async(cls, name: str | None = None, namespace: str | None = None, *, timeout_s: float = 30.0) -> Shards:
        """``lookup`` for event loops: the same answer, awaited. Finding a name asks the GCS,
        which blocks, so it runs in a thread; the shard count is an awaited ``ping``, never a
        ``ray.get`` (which, in an async actor, blocks its loop and makes Ray warn)."""
        name, namespace = registry_address(name, namespace)
        first = await asyncio.to_thread(find_actor, name, namespace)
        try:
            count = (await asyncio.wait_for(first.ping.remote(), timeout_s)).get("shards", 1)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise _silent(name, exc) from None
        others = [await asyncio.to_thread(find_actor, shard_name(name, i), namespace) for i in range(1, count)]
        return cls(name, namespace, [first, *others])


def _silent(name: str, exc: BaseException) -> Unavailable:
    return Unavailable(f"the registry actor {name!r} does not answer ({type(exc).__name__}); retry shortly")


def find_actor(name: str, namespace: str) -> ray.actor.ActorHandle:
    """The actor ``name`` in ``namespace``; ``Unavailable`` (saying what to check) if none."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise Unavailable(
            f"no registry actor named {name!r} in namespace {namespace!r}; is the epd app running, "
            "and do registry_name/registry_namespace match its config?"
        ) from None


def lookup_shards(name: str | None = None, namespace: str | None = None) -> Shards:
    """Every shard of the running registry (blocking); ``Unavailable`` if one is missing."""
    return Shards.lookup(name, namespace)


def lookup_registry(
    name: str | None = None, namespace: str | None = None, *, req_id: str | None = None
) -> ray.actor.ActorHandle:
    """The running registry's actor that holds ``req_id`` (with one shard, the only one;
    without ``req_id``, shard 0); ``Unavailable`` if there is none under that name."""
    if req_id is not None:
        return lookup_shards(name, namespace).of(req_id)
    return find_actor(*registry_address(name, namespace))
