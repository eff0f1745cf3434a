"""The Serve applications: the ``Encoder`` and ``Ingress`` deployments and ``build_app``; the
``EPDProxy`` deployment (OpenAI chat in front of vLLM) and ``build_proxy_app``."""

from deployments.app import build_app, build_proxy_app, compose_app
from deployments.config import AppConfig, BatchConfig, ModelConfig, ProxyConfig
from deployments.encoder import Encoder
from deployments.ingress import Ingress
from deployments.proxy import EPDProxy

__all__ = [
    "AppConfig",
    "BatchConfig",
    "EPDProxy",
    "Encoder",
    "Ingress",
    "ModelConfig",
    "ProxyConfig",
    "build_app",
    "build_proxy_app",
    "compose_app",
]
