"""The registry's server side: the detached actor and what only it uses.

``actor.EmbeddingRegistry`` is a thin async shell around ``state.RegistryState`` (the
lifecycle, a plain state machine; ``entries`` holds its records and tombstones);
``rank_calls.RankCalls`` answers the decoder ranks for it, sharing its ``changes.Changes``
(who waits for which req_id) and ``call_errors.CallErrors`` (the shard check, the error
count); ``encodes`` and ``batched_calls`` get items encoded by the ``Encoder`` deployment;
``create`` makes the actors. Decoders never import this package (``registry.client``).
"""
