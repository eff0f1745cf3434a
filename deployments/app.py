"""Building the Serve applications: ``build_app`` for config files, ``compose_app`` for Python,
and ``build_proxy_app`` for the OpenAI-compatible proxy in front of a vLLM server."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from ray.serve import Application

from deployments.config import AppConfig, ProxyConfig
from deployments.encoder import Encoder
from deployments.ingress import Ingress
from deployments.proxy import EPDProxy
from deployments.schemas import describe_validation_error


_DEPLOYMENTS = {"Encoder": Encoder, "Ingress": Ingress}


def build_app(args: dict[str, Any]) -> Application:
    """The builder ``serve_config.yaml`` names: validate ``args`` (see ``AppConfig``), build the app.

    YAML: ``import_path: deployments.app:build_app``, the ``AppConfig`` keys under ``args``,
    Serve options per deployment under ``deployments:``.
    """
    return compose_app(args)


def build_proxy_app(args: dict[str, Any]) -> Application:
    """The ``EPDProxy`` app: validate ``args`` (see ``ProxyConfig``), build it.

    It stages the images of OpenAI chat requests in the encoder app named
    ``encoder_app`` (deploy that one too) and forwards the requests to ``vllm_url``::

        from ray import serve
        from deployments import build_proxy_app
        serve.run(build_proxy_app({"vllm_url": "http://127.0.0.1:8100", "tensor_parallel_size": 2}),
                  name="epd-proxy", route_prefix="/proxy")

    YAML: ``import_path: deployments.app:build_proxy_app``, the ``ProxyConfig`` keys under
    ``args``, Serve options under ``deployments: [{name: EPDProxy, ...}]``.

    Raises:
        ValueError: ``args`` is not a valid ``ProxyConfig``; the message names the field.
    """
    try:
        config = ProxyConfig.model_validate(args or {})
    except ValidationError as exc:
        raise ValueError(describe_validation_error(exc).replace("invalid request", "invalid epd proxy args")) from None
    return EPDProxy.bind(config.model_dump())


def compose_app(
    args: dict[str, Any] | None = None, *, deployment_options: dict[str, dict[str, Any]] | None = None
) -> Application:
    """The app from Python: the ``Ingress`` bound to the ``Encoder`` it hands its requests to.

    The call path is Ingress -> registry (a detached actor) -> Encoder: the Ingress gives
    the registry the Encoder deployment it was bound to, and the registry makes every
    encode call itself, because the caller of a handle owns the result's object and the
    staged embeddings must outlive the replica that computed them (``registry.server.encodes``).
    The Ingress calls the Encoder directly only for ``/health``.

    ``deployment_options`` is the Python form of the config file's ``deployments:``
    list: Serve options per deployment name, e.g.
    ``{"Encoder": {"num_replicas": 2, "ray_actor_options": {"num_gpus": 1}}}``::

        from ray import serve
        from deployments import compose_app
        serve.run(compose_app({"default_receive_count": 2}), name="epd", route_prefix="/")
    """
    try:
        config = AppConfig.model_validate(args or {})
    except ValidationError as exc:
        raise ValueError(describe_validation_error(exc).replace("invalid request", "invalid epd app args")) from None
    options = deployment_options or {}
    unknown = set(options) - set(_DEPLOYMENTS)
    if unknown:
        raise ValueError(f"deployment_options names unknown deployments {sorted(unknown)}; known: {sorted(_DEPLOYMENTS)}")
    encoder, ingress = (_DEPLOYMENTS[name].options(**options.get(name, {})) for name in ("Encoder", "Ingress"))
    return ingress.bind(encoder.bind(config.model.model_dump()), config.model_dump())
