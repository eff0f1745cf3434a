"""``build_app``: the application builder that ``serve_config.yaml`` names."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from ray.serve import Application

from deployments.config import AppConfig
from deployments.encoder import Encoder
from deployments.ingress import Ingress
from deployments.schemas import describe_validation_error


_DEPLOYMENTS = {"Encoder": Encoder, "Ingress": Ingress}


def build_app(
    args: dict[str, Any] | None = None, *, deployment_options: dict[str, dict[str, Any]] | None = None
) -> Application:
    """Validate ``args`` (see ``AppConfig``) and return the app: Ingress -> Encoder.

    ``deployment_options`` is the Python form of the config file's ``deployments:``
    list: Serve options per deployment name, e.g.
    ``{"Encoder": {"num_replicas": 2, "ray_actor_options": {"num_gpus": 1}}}``.

    Python::

        from ray import serve
        from deployments import build_app
        serve.run(build_app({"default_receive_count": 2}), name="epd", route_prefix="/")

    YAML: ``import_path: deployments.app:build_app`` with the same keys under ``args``.
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
