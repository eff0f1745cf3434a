"""vLLM's encoder-cache connector: ``connector`` (both roles), ``scheduler_view`` (the
scheduler's local table of entry states), ``worker`` (loads on each TP rank),
``finder`` (finding the registry off the scheduler's thread), ``metrics`` (EC stats)."""
