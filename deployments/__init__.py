"""The Serve application: the ``Encoder`` and ``Ingress`` deployments and ``build_app``."""

from deployments.app import build_app, compose_app
from deployments.config import AppConfig, BatchConfig, ModelConfig
from deployments.encoder import Encoder
from deployments.ingress import Ingress

__all__ = ["AppConfig", "BatchConfig", "Encoder", "Ingress", "ModelConfig", "build_app", "compose_app"]
