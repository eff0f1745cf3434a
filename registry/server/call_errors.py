"""The errors the registry's calls answer with, counted and logged in one place.

The actor (``registry.server.actor``) and its decoder ranks' calls
(``registry.server.rank_calls``) share one ``CallErrors``: every call about req_ids checks
first that this shard holds them, and every ``RegistryError`` the registry answers with
goes through ``count`` once, so the error metric and the log line about it cannot disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from registry.errors import InvalidRequest, Overloaded, RegistryError
from registry.logs import RateLimited, error_fields, get_logger, log_error
from registry.routing import shard_of
from registry.server.metrics import RegistryMetrics

logger = get_logger("registry.server.actor")  # the actor's own lines: one logger for the whole registry


class CallErrors:
    """Shard ``shard`` of ``shards`` of the registry ``name``: its ownership check and its
    error count. ``ensure_running()`` starts the actor's background tasks, whose publisher
    hands the counts to Ray."""

    def __init__(self, name: str, shard: int, shards: int, metrics: RegistryMetrics, ensure_running: Callable[[], None]):
        self._name, self._shard, self._shards = name, shard, shards
        self._metrics = metrics
        self._ensure_running = ensure_running
        self._overload_log = RateLimited(logger)

    def check_owned(self, *req_ids: str) -> None:
        """A req_id sent to a shard that does not hold it is a client's routing bug: refused,
        so it can never create an entry no rank would find."""
        if self._shards == 1:
            return
        for req_id in req_ids:
            if isinstance(req_id, str) and (owner := shard_of(req_id, self._shards)) != self._shard:
                error = InvalidRequest(
                    f"req_id {req_id} belongs to shard {owner} of the registry {self._name!r}, not {self._shard}; "
                    "find its shard with registry.lookup_shards().of(req_id)",
                    req_id,
                )
                self.count(error)
                raise error

    def count(self, error: RegistryError) -> None:
        """Count ``error`` and log it: the one line about it, with its req_id, code and cause."""
        self._ensure_running()
        self._metrics.errors.inc(tags={"code": error.code})
        if isinstance(error, Overloaded):  # a flood of them must not flood the log
            self._overload_log.log(logging.WARNING, "overloaded", "request refused: %s", error_fields(error))
        else:
            log_error(logger, error)
