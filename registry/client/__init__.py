"""The decoder's side: what a tensor-parallel rank imports to receive embeddings.

``receiver.EmbeddingReceiver`` (Ray actors and drivers), ``zmq_receiver`` (processes
outside Ray), ``received_item.ReceivedItem`` (what either hands back) and ``shards``
(finding the registry's actors). Never imports the server side or Ray Serve
(``tests/unit/test_imports.py`` checks it).
"""
