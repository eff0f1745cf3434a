"""The registry's server side: the detached actor and what only it uses.

``actor.EmbeddingRegistry`` is a thin async shell around ``state.RegistryState`` (the
lifecycle, a plain state machine); ``rank_calls.RankCalls`` answers the decoder ranks;
``encodes`` and ``batched_calls`` get items encoded by the ``Encoder`` deployment;
``create`` makes the actors. Decoders never import this package (``registry.client``).
"""
