"""Creating the registry's actors with the options they must have (the server side;
finding running ones is ``registry.client.shards``')."""

from __future__ import annotations

import dataclasses

import ray

from registry.logs import get_logger
from registry.client.shards import Shards
from registry.routing import shard_name
from registry.settings import RegistrySettings

logger = get_logger(__name__)


def get_or_create_shards(settings: RegistrySettings) -> Shards:
    """Every shard of the registry named by ``settings`` (app-wide settings), created if
    missing (blocking). The shard count is fixed when shard 0 is created: a config that
    asks for another count is told so in the log and runs with the existing one.
    """
    first = get_or_create_registry(settings.for_shard(0))
    count = ray.get(first.ping.remote()).get("shards", 1)
    if count != settings.registry_shards:
        logger.warning(
            "registry_shards is %d in the new config but the registry %r was created with %d shards; "
            "it takes effect only when the registry actors are created again",
            settings.registry_shards, settings.name, count,
        )
        settings = dataclasses.replace(settings, registry_shards=count)
    handles = [first] + [get_or_create_registry(settings.for_shard(i)) for i in range(1, count)]
    return Shards(settings.name, settings.namespace, handles, settings)


def get_or_create_registry(settings: RegistrySettings) -> ray.actor.ActorHandle:
    """The registry shard named by ``settings`` (``settings.for_shard(i)``), created if it
    does not exist yet.

    Detached, so it outlives the replica that created it and every redeploy;
    ``max_restarts=-1`` brings it back after a crash (with an empty table: the
    objects it owned died with it). It is pinned to the head node, the node whose
    loss ends the cluster anyway, so a worker node's death never takes it down.
    ``num_cpus=0`` keeps it from starving replicas of CPUs on small machines.
    """
    # Here, not at the top: the actor class imports Ray Serve, which a decoder rank that
    # only looks the registry up (``EmbeddingReceiver``) should not have to load.
    from registry.server.actor import EmbeddingRegistry

    actor_cls = ray.remote(EmbeddingRegistry)
    return actor_cls.options(
        name=shard_name(settings.name, settings.shard),
        namespace=settings.namespace,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_concurrency=settings.registry_max_concurrency,
        num_cpus=0,
        resources={"node:__internal_head__": 0.001},
    ).remote(settings)
