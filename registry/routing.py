"""Which registry shard holds a req_id: the one rule every side computes the same way.

A req_id belongs to shard ``crc32(utf-8 of req_id) % N`` of a registry of N shards;
shard 0 runs under the registry's name, shard ``i > 0`` under ``"{name}.{i}"``. Any
client, in any language, can route with nothing to ask first except N.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any


def shard_of(req_id: str, shards: int) -> int:
    """The shard that holds ``req_id`` among ``shards``."""
    if shards == 1:
        return 0
    return zlib.crc32(req_id.encode("utf-8", "surrogatepass")) % shards


def shard_name(name: str, shard: int) -> str:
    """The actor name of shard ``shard`` of the registry called ``name``."""
    return name if shard == 0 else f"{name}.{shard}"


def sum_stats(per_shard: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One ``stats`` answer for the whole registry: every count (all of them are) summed over
    the shards; ``max_staged_bytes`` sums each shard's share to the app-wide limit."""
    total: dict[str, Any] = {}
    for stats in per_shard:
        for key, value in stats.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                total.setdefault(key, value)
            else:
                total[key] = total.get(key, 0) + value
    return total
