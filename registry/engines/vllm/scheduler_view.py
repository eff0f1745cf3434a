"""An engine scheduler's local view of the registry entries its requests name.

A vLLM scheduler asks about every multimodal item several times per step
(``ensure_cache_available``, then ``has_cache_item`` twice), so the answers come
from this table, never from a registry call. The table is kept current by one
long-poll ``watch`` call at a time (see ``registry.vllm_connector``); this module
is the plain-Python part, driven by tests without Ray or vLLM.

An item identifier is the registry ``req_id`` of a one-item encode. Per
identifier the view holds the registry state last heard (``None``: asked, no
answer yet). What the scheduler is told:

* ``ready``: every item a request still needs is decided: not ``None``, not
  ``pending``. Staged items load from the registry; ``unknown`` and ``released``
  ones (never encoded for this engine, or already delivered to it) are computed
  by the engine itself.
* ``has``: the item is ``pending`` or ``staged`` in the registry.
* An item that ended ``failed``, ``expired`` or ``cancelled``, or went ``unknown``
  after being live (a registry restart lost it), before the workers were told to
  load it: with ``local_fallback`` (the default) the engine computes it itself, as
  it would without the service (``take_fallbacks`` says which, once each, for the
  log); without, its requests are unavailable.
* ``take_unavailable``: requests that cannot get an item: it ended as above without
  ``local_fallback``, or a worker could not load it.

A worker that fails to load an item leaves a placeholder in its encoder cache so
the step runs; the engine then believes the item is cached. Such an identifier is
*poisoned*: a later request naming it waits until the registry holds it staged
again and the workers reload it over the placeholder, and fails if it cannot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from registry.states import CANCELLED, EXPIRED, FAILED, PENDING, STAGED, UNKNOWN

_LIVE = (PENDING, STAGED)
_ENDED_BADLY = (FAILED, EXPIRED, CANCELLED)
# Poisoned identifiers remembered at most (oldest forgotten first).
MAX_POISONED = 65_536


class EngineView:
    def __init__(self, local_fallback: bool = True) -> None:
        self.local_fallback = local_fallback
        self._fallbacks: dict[str, str] = {}  # identifier -> why the engine computes it, not yet logged
        self._states: dict[str, str | None] = {}  # identifier -> last registry state heard
        self._users: dict[str, set[str]] = {}  # identifier -> engine request ids naming it
        self._requests: dict[str, tuple[str, ...]] = {}  # engine request id -> its identifiers
        self._handed: set[str] = set()  # identifiers given to the workers to load
        self._poisoned: OrderedDict[str, str] = OrderedDict()  # identifier -> why
        self._reloads: set[str] = set()
        self._unavailable: dict[str, str] = {}  # engine request id -> why
        self._asked: dict[int, dict[str, str | None]] = {}  # registry shard -> what its watch in flight was sent

    # --- the scheduler's questions -----------------------------------------------

    def track(self, request_id: str, identifiers: Iterable[str]) -> bool:
        """Note that ``request_id`` names ``identifiers``; False if it was already tracked."""
        if request_id in self._requests:
            return False
        identifiers = tuple(dict.fromkeys(identifiers))
        self._requests[request_id] = identifiers
        for identifier in identifiers:
            users = self._users.setdefault(identifier, set())
            if not users:  # nobody watched it: whatever was heard before is stale
                self._states[identifier] = None
                self._handed.discard(identifier)
            elif self._states.get(identifier) not in (None, *_LIVE) and identifier not in self._handed:
                # Decided for an earlier request and no longer watched since: it may have been
                # staged (or encoded afresh) meanwhile, so a new request asks again.
                self._states[identifier] = None
            users.add(request_id)
        return True

    def ready(self, request_id: str, needed: Iterable[str]) -> bool:
        """Whether the request may be scheduled: its ``needed`` items are decided."""
        if request_id in self._unavailable:
            return False  # failed at the next update_from_output; never scheduled meanwhile
        for identifier in needed:
            state = self._states.get(identifier)
            if state is None or state == PENDING:
                return False
            if identifier in self._poisoned:
                if state != STAGED:
                    self._mark(identifier, f"{identifier}: {self._poisoned[identifier]}; it is {state} now")
                    return False
                self._reloads.add(identifier)
        return True

    def has(self, identifier: str) -> bool:
        return self._states.get(identifier) in _LIVE

    def hand_over(self, identifier: str) -> None:
        """The workers are told to load ``identifier`` this step."""
        self._handed.add(identifier)

    def take_reloads(self) -> set[str]:
        reloads, self._reloads = self._reloads, set()
        self._handed |= reloads
        return reloads

    def take_unavailable(self) -> dict[str, str]:
        """Engine request id -> reason, each reported once."""
        unavailable, self._unavailable = self._unavailable, {}
        return {request_id: why for request_id, why in unavailable.items() if request_id in self._requests}

    def finish(self, request_id: str) -> list[str]:
        """The request is done; returns the identifiers no tracked request names any more."""
        forgotten = []
        for identifier in self._requests.pop(request_id, ()):
            users = self._users.get(identifier)
            if users is not None:
                users.discard(request_id)
                if not users:
                    del self._users[identifier]
                    self._states.pop(identifier, None)
                    self._handed.discard(identifier)
                    forgotten.append(identifier)
        self._unavailable.pop(request_id, None)
        return forgotten

    # --- what the registry says --------------------------------------------------

    def to_watch(self) -> dict[str, str | None]:
        """Identifiers in use whose state can still change for us, with the state known."""
        return {
            identifier: state
            for identifier, state in self._states.items()
            if (state is None or state in _LIVE) and identifier not in self._handed
        }

    def awaiting(self) -> bool:
        """Some request waits for an item the registry has not decided (not heard of yet, or
        pending): the scheduler has news to wait for."""
        return any(
            (state is None or state == PENDING) and identifier not in self._handed
            for identifier, state in self._states.items()
        )

    def watch_is_stale(self, shard: int = 0, wanted: Iterable[str] | None = None) -> bool:
        """The watch in flight to ``shard`` was sent before identifiers it should name
        (``wanted``, by default all of ``to_watch``) were added."""
        asked = self._asked.get(shard)
        return asked is not None and not set(self.to_watch() if wanted is None else wanted) <= asked.keys()

    def asked(self, known: dict[str, str | None] | None, shard: int = 0) -> None:
        """A watch to ``shard`` was sent ``known`` (None: it has answered or was dropped)."""
        if known is None:
            self._asked.pop(shard, None)
        else:
            self._asked[shard] = known

    def asked_of(self, shard: int) -> dict[str, str | None]:
        """What the watch in flight to ``shard`` was sent (empty if none)."""
        return dict(self._asked.get(shard, {}))

    def unanswered(self, identifiers: Iterable[str], why: str) -> None:
        """The registry did not answer about ``identifiers`` in time: those still undecided are
        decided without it. Never heard of: ``unknown``, the engine computes them (as when there
        is no registry to ask); pending: as an item that ended badly (``why`` says why)."""
        for identifier in identifiers:
            state = self._states.get(identifier, UNKNOWN)
            if identifier not in self._users or identifier in self._handed or state not in (None, PENDING):
                continue
            self._states[identifier] = UNKNOWN
            if state == PENDING:
                self._ended(identifier, why)

    def apply(self, states: dict[str, str]) -> None:
        """Apply a watch answer: req_id -> its state now."""
        for identifier, state in states.items():
            if identifier not in self._users:
                continue  # its requests finished meanwhile
            before = self._states.get(identifier)
            self._states[identifier] = state
            if identifier in self._handed:
                continue
            if state in _ENDED_BADLY:
                self._ended(identifier, f"it is {state} in the registry")
            elif state == UNKNOWN and before in _LIVE:
                self._ended(identifier, f"it was {before} and is unknown to the registry now (it restarted)")

    def _ended(self, identifier: str, why: str) -> None:
        if self.local_fallback and identifier not in self._poisoned:
            self._fallbacks[identifier] = why  # decided, and not live: the engine computes it
        else:
            self._mark(identifier, f"{identifier}: {why}")

    def take_fallbacks(self) -> dict[str, str]:
        """Identifiers the engine computes itself because the service could not deliver them
        (-> why), each reported once."""
        fallbacks, self._fallbacks = self._fallbacks, {}
        return fallbacks

    # --- the workers' report -----------------------------------------------------

    def loaded(self, identifiers: Iterable[str]) -> None:
        for identifier in identifiers:
            self._poisoned.pop(identifier, None)

    def load_failed(self, failures: dict[str, str]) -> None:
        for identifier, why in failures.items():
            self._poisoned[identifier] = f"a worker could not load it ({why})"
            self._poisoned.move_to_end(identifier)
            while len(self._poisoned) > MAX_POISONED:
                self._poisoned.popitem(last=False)
            self._mark(identifier, f"{identifier}: {self._poisoned[identifier]}")

    def _mark(self, identifier: str, why: str) -> None:
        for request_id in self._users.get(identifier, ()):
            self._unavailable.setdefault(request_id, why)

    # --- views for logs and tests ------------------------------------------------

    def state(self, identifier: str) -> str | None:
        return self._states.get(identifier)

    def tracked(self) -> int:
        return len(self._requests)

