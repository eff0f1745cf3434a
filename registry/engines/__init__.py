"""Adapters that let serving engines consume the registry through their own interfaces.

``vllm``: vLLM's encoder-cache connector (``ECConnectorBase``), public as
``registry.vllm_connector``. Adapters build on ``registry.client`` and never import the
server side.
"""
