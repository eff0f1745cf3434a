"""The names of an entry's states, which every side speaks: the server moves entries
between them (``registry.server.state``), clients and engine adapters read them
(``states``, ``watch``). The rules live with the server; only the names live here.
"""

PENDING, STAGED, RELEASED, EXPIRED, CANCELLED, FAILED = (
    "pending", "staged", "released", "expired", "cancelled", "failed",
)
# What ``state_of`` answers for a req_id with no entry and no tombstone: never seen,
# aged out, or lost with a registry restart.
UNKNOWN = "unknown"
LIVE_STATES = (PENDING, STAGED)
TERMINAL_STATES = (RELEASED, EXPIRED, CANCELLED, FAILED)
# Most entries one page of ``list_entries`` holds (the registry's and the HTTP route's bound).
MAX_LIST_LIMIT = 1000
# The receive_count of an entry whose ranks will say how many they are (``claim``).
OPEN = 0
