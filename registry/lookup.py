"""Finding the registry actor, and creating it with the options it must have."""

from __future__ import annotations

import ray

from registry.errors import Unavailable
from registry.settings import RegistrySettings, registry_address


def get_or_create_registry(settings: RegistrySettings) -> ray.actor.ActorHandle:
    """The registry named by ``settings``, created if it does not exist yet.

    Detached, so it outlives the replica that created it and every redeploy;
    ``max_restarts=-1`` brings it back after a crash (with an empty table: the
    objects it owned died with it). It is pinned to the head node, the node whose
    loss ends the cluster anyway, so a worker node's death never takes it down.
    ``num_cpus=0`` keeps it from starving replicas of CPUs on small machines.
    """
    # Here, not at the top: the actor class imports Ray Serve, which a decoder rank that
    # only looks the registry up (``EmbeddingReceiver``) should not have to load.
    from registry.actor import EmbeddingRegistry

    actor_cls = ray.remote(EmbeddingRegistry)
    return actor_cls.options(
        name=settings.name,
        namespace=settings.namespace,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_concurrency=settings.registry_max_concurrency,
        num_cpus=0,
        resources={"node:__internal_head__": 0.001},
    ).remote(settings)


def lookup_registry(name: str | None = None, namespace: str | None = None) -> ray.actor.ActorHandle:
    """The running registry; ``Unavailable`` if there is none under that name."""
    name, namespace = registry_address(name, namespace)
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise Unavailable(
            f"no registry actor named {name!r} in namespace {namespace!r}; is the epd app running, "
            "and do registry_name/registry_namespace match its config?"
        ) from None
