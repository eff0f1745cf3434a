"""Benchmarks of the encoder service: one command, ``python -m benchmarks [--quick] [--out DIR]``.

It starts a local Ray cluster of its own (never touching another one), measures
in one run, each against baselines measured side by side,

1. ``fetch``: a TP rank's ``EmbeddingReceiver.fetch`` of a staged embedding (0.5, 4.7,
   19 MB, bf16) vs one async actor round trip + one memcpy, and vs ZMQ PUSH/PULL;
2. ``staging``: output tensor -> staged, registry-owned object, per MB, vs ``ray.put``
   and memcpy, with and without ``RAY_preallocate_plasma_memory``;
3. ``registry``: lifecycles per second (submit + 4 fetches + release) vs the raw
   pipelined rate of a no-op async actor, and the registry calls per lifecycle;
3b. ``scale``: lifecycles/s and CPU per lifecycle for 1, 2 and 4 registry shards,
   ``fetch_many`` vs the same fetches in flight, and a quiet fetch vs round trip + memcpy;
4. ``e2e``: images/s through HTTP and the Python handle vs the same model in one
   process, for the tiny model and a ViT-B-sized tower;
5. ``memory``: peak object-store bytes per staged byte in a burst, and the return
   to baseline;

and writes ``results.json`` (schema: ``benchmarks.schema``), ``results.md`` and two
PNG plots into the output directory (default ``benchmarks/results``). Each section's
module docstring states what it measures and how. The default mode takes about
6 minutes on a 2-core machine; ``--quick`` (the CI smoke run) one to two
(docs/performance.md says where the time goes).
"""
