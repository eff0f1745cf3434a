"""The scheduler side of ``registry.vllm_connector.RayRegistryECConnector``: one per engine,
in the scheduler's process.

vLLM's scheduler asks about every multimodal item several times per step; the answers come
from a local ``EngineView``, never from a registry call. One long-poll ``watch`` per registry
shard holding any item in use keeps it current (``sync``: checked without blocking, at most
once per new request and once per step), and the registry is found on a thread of its own
(``RegistryFinder``), started with the engine so that its first request does not wait for it.

Three rules keep an engine from stalling on the service:

* **While the engine has work, the scheduler never waits on the registry.**
* **While it has none but requests waiting for their items, it waits for the registry's
  next answer instead of stepping** (``build_meta`` on an empty step: up to 50 ms, then, if
  no answer came, up to 1.5 s per empty step until one comes or there is work). vLLM steps
  an engine that has waiting requests in a loop, and every step, empty or not, goes to
  every TP worker, which then spins for a second (vLLM's ``SpinCondition``) waiting for the
  next. With TP 2 on two cores those spinning workers took both cores, and the registry
  got no CPU to answer: requests waited past ``ttl_s`` for items staged before they
  arrived. So after a first short wait the scheduler waits longer than the workers spin;
  once they rest, the registry answers. A wait ends at the registry's answer, so it adds no
  latency to the requests it is for; a request arriving meanwhile waits at most 1.5 s, and
  only while the engine has nothing else to run. Only with one pipeline stage: with more,
  an empty step may have a batch in flight.
* **The registry has ``registry_deadline_s`` to answer** (``ConnectorSettings``): a lookup
  or watch silent for longer means the registry is stuck; the items it left undecided are
  then treated as when it cannot be reached (never heard of: the engine encodes them; pending:
  the engine encodes them with ``local_fallback``, else their requests fail), and it is
  looked up afresh for later requests.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from registry.engines.vllm.finder import RegistryFinder
from registry.engines.vllm.metadata import ConnectorSettings, ItemLoad, RayRegistryECMetadata
from registry.engines.vllm.metrics import RegistryECStats
from registry.engines.vllm.scheduler_view import EngineView

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.ec_connector.ray_registry")

# How often a scheduler that cannot find the registry looks for it again.
_LOOKUP_RETRY_S = 1.0
# The wait on an empty step: the first, then each later one until news (longer than the
# second vLLM's TP workers spin after a step, so that they rest).
IDLE_WAIT_FIRST_S = 0.05
IDLE_WAIT_MAX_S = 1.5


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, may_wait_when_idle: bool = True):
        self.settings = settings
        self.view = EngineView(settings.local_fallback)
        self._finder = RegistryFinder(
            settings.registry_name, settings.registry_namespace, settings.ray_address, _LOOKUP_RETRY_S,
            owner="RayRegistryECConnector: ", timeout_s=settings.registry_deadline_s,
        )
        self._finder.shards()  # look now, while the engine loads
        self._watches: dict[int, tuple[Any, float]] = {}  # registry shard -> (its watch in flight, when sent)
        self._num_tokens: dict[str, int] = {}  # identifier -> its tokens, while a request names it
        self._loads: dict[str, int] = {}
        self._synced_this_step = False
        self.stats = RegistryECStats()
        self._first_seen: dict[str, float] = {}  # request_id -> when a step first considered it
        self._may_wait = may_wait_when_idle
        self._idle_wait_s = IDLE_WAIT_FIRST_S

    # --- vLLM's scheduler calls ---------------------------------------------------

    def ensure(self, request: "Request", num_computed_tokens: int) -> bool:
        features = request.mm_features
        self._first_seen.setdefault(request.request_id, time.monotonic())
        new = self.view.track(request.request_id, (f.identifier for f in features))
        if new or not self._synced_this_step:
            self.sync()
        needed = []
        for feature in features:
            self._num_tokens[feature.identifier] = feature.mm_position.get_num_embeds()
            if feature.mm_position.offset + feature.mm_position.length > num_computed_tokens:
                needed.append(feature.identifier)
        return self.view.ready(request.request_id, needed)

    def finish(self, request_id: str) -> None:
        self._first_seen.pop(request_id, None)
        for identifier in self.view.finish(request_id):
            self._num_tokens.pop(identifier, None)

    def after_alloc(self, request: "Request", index: int) -> None:
        identifier = request.mm_features[index].identifier
        if self.view.has(identifier):
            self._loads[identifier] = request.get_num_encoder_embeds(index)
            self.view.hand_over(identifier)
            self.stats.waited(time.monotonic() - self._first_seen.get(request.request_id, time.monotonic()))

    def build_meta(self, scheduler_output: "SchedulerOutput") -> RayRegistryECMetadata:
        loads = [ItemLoad(identifier, count) for identifier, count in self._loads.items()]
        loads += [ItemLoad(i, self._num_tokens[i], reload=True) for i in self.view.take_reloads() if i not in self._loads]
        loads += self._settled_elsewhere(scheduler_output, {load.identifier for load in loads})
        self._loads.clear()
        self._synced_this_step = False
        if self._may_wait and not scheduler_output.total_num_scheduled_tokens and self.view.awaiting():
            heard = self._wait_for_news(self._idle_wait_s)
            self._idle_wait_s = IDLE_WAIT_FIRST_S if heard else IDLE_WAIT_MAX_S
        else:
            self._idle_wait_s = IDLE_WAIT_FIRST_S
        return RayRegistryECMetadata(tuple(loads))

    def take_unavailable(self) -> set[str]:
        self.sync()
        for identifier, why in self.view.take_fallbacks().items():
            logger.warning("req_id=%s: %s; the engine encodes it itself", identifier, why)
        unavailable = self.view.take_unavailable()
        for request_id, why in unavailable.items():
            logger.warning("vLLM request %s fails: its encoder input is unavailable: %s", request_id, why)
        return set(unavailable)

    # --- the registry -------------------------------------------------------------

    def sync(self) -> None:
        """Apply the watches' answers that came, give up on a silent registry, and keep one
        watch in flight per shard in use. Never blocks."""
        import ray

        self._synced_this_step = True
        for shard, (ref, sent) in list(self._watches.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                del self._watches[shard]
                self.view.asked(None, shard)
                try:
                    self.view.apply(ray.get(ref))
                except Exception as exc:  # noqa: BLE001 - the registry restarted or is gone: look again
                    logger.warning("registry watch failed (%s: %s); retrying", type(exc).__name__, exc)
                    self._finder.forget()
            elif time.monotonic() - sent > self.settings.registry_deadline_s:
                self._silent(shard, ref)
        known = self.view.to_watch()
        if not known:
            return
        shards = self._finder.shards()  # looked up on a thread of its own: never waited for here
        if shards is None:
            if self._finder.failed:
                # No registry to ask: what nobody could have encoded is computed by the engine.
                self.view.apply({identifier: "unknown" for identifier, state in known.items() if state is None})
            # Else a lookup is under way: the requests naming these items wait for it.
            return
        # One watch in flight per shard holding any of them, naming all of that shard's.
        for shard, identifiers in shards.group(known).items():
            if shard in self._watches:
                if not self.view.watch_is_stale(shard, identifiers):
                    continue
                ray.cancel(self._watches.pop(shard)[0])  # it lacks identifiers added since: ask again
            subset = {identifier: known[identifier] for identifier in identifiers}
            self._watches[shard] = (shards.handles[shard].watch.remote(subset, self.settings.watch_timeout_s), time.monotonic())
            self.view.asked(subset, shard)

    def _silent(self, shard: int, ref: Any) -> None:
        """Shard ``shard`` did not answer its watch within the deadline: it is stuck."""
        import ray

        deadline = self.settings.registry_deadline_s
        logger.warning(
            "registry shard %d did not answer a watch within %g s (registry_deadline_s); "
            "the items it left undecided are encoded by the engine itself; looking the registry up again",
            shard, deadline,
        )
        del self._watches[shard]
        ray.cancel(ref)
        asked = self.view.asked_of(shard)
        self.view.asked(None, shard)
        self.view.unanswered(asked, f"the registry did not answer within {deadline:g} s")
        self._finder.forget()

    def _wait_for_news(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a watch's answer or the lookup's end; True if one came."""
        import ray

        if self._watches:
            ready, _ = ray.wait([ref for ref, _ in self._watches.values()], num_returns=1, timeout=timeout_s)
            return bool(ready)
        return self._finder.wait(timeout_s)

    # --- items the engine got elsewhere -------------------------------------------

    def _settled_elsewhere(self, scheduler_output: "SchedulerOutput", loading: set[str]) -> list[ItemLoad]:
        """Items of requests scheduled for the first time that the engine neither loads nor
        encodes: its encoder cache or prefix cache had them. Staged for this engine, they would
        wait for their ttl; the ranks acknowledge them instead. (Items of a prompt's later
        chunks that hit the engine's cache are not seen here and wait for their ttl.)"""
        settled = []
        for new in scheduler_output.scheduled_new_reqs:
            encoded_here = set(scheduler_output.scheduled_encoder_inputs.get(new.req_id, ()))
            covered = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            for index, feature in enumerate(new.mm_features or ()):
                identifier, position = feature.identifier, feature.mm_position
                if (
                    position.offset + position.length <= covered
                    and index not in encoded_here
                    and identifier not in loading
                    and self.view.state(identifier) == "staged"
                ):
                    settled.append(ItemLoad(identifier, position.get_num_embeds(), acknowledge_only=True))
                    loading.add(identifier)
                    self.view.hand_over(identifier)
        return settled
