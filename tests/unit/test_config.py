"""App config: defaults, the shipped YAML files, and messages for bad values (no Ray)."""

import pathlib

import pytest
import yaml

import inspect

from deployments import AppConfig, BatchConfig, build_app, compose_app
from deployments.schemas import parse_encode_request
from registry.errors import InvalidRequest
from registry.settings import registry_address

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config.gpu.yaml"])
def test_shipped_configs_validate(name):
    config = yaml.safe_load((ROOT / name).read_text())
    (app,) = config["applications"]
    assert (app["name"], app["route_prefix"], app["import_path"]) == ("epd", "/", "deployments.app:build_app")
    args = AppConfig.model_validate(app["args"])
    for deployment in app["deployments"]:
        if "user_config" in deployment:
            BatchConfig.model_validate(deployment["user_config"])
    build_app(app["args"])
    assert {"registry_name", "registry_namespace", "default_receive_count", "ttl_s"} <= set(app["args"])
    if name == "serve_config.yaml":
        assert args.model.device == "auto"  # runs without a GPU


def test_receiver_defaults_match_serve_config(monkeypatch):
    monkeypatch.delenv("EPD_REGISTRY_NAME", raising=False)
    monkeypatch.delenv("EPD_REGISTRY_NAMESPACE", raising=False)
    args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    assert registry_address() == (args["registry_name"], args["registry_namespace"])
    monkeypatch.setenv("EPD_REGISTRY_NAME", "other")
    assert registry_address()[0] == "other"
    assert registry_address("explicit")[0] == "explicit"


def test_app_config_defaults():
    cfg = AppConfig()
    assert (cfg.default_receive_count, cfg.max_receive_count, cfg.ttl_s) == (1, 64, 180.0)
    settings = cfg.registry_settings("epd")
    assert settings.limits.ttl_s == 180.0 and settings.encoder_app == "epd"


@pytest.mark.parametrize(
    "args,message",
    [
        ({"ttl_s": 0}, "ttl_s"),
        ({"default_receive_count": 100}, "exceeds max_receive_count"),
        ({"model": {"family": "gpt"}}, "unknown model family"),
        ({"model": {"dtype": "int8"}}, "model.dtype"),
        ({"ttl": 5}, "ttl: Extra inputs are not permitted"),
    ],
)
def test_bad_app_args_name_the_field(args, message):
    with pytest.raises(ValueError, match=message):
        build_app(args)


def test_unknown_deployment_options_are_refused():
    with pytest.raises(ValueError, match="unknown deployments"):
        compose_app({}, deployment_options={"Encodr": {}})


def test_build_app_takes_exactly_one_parameter():
    # Serve refuses config-file builders with any other signature.
    assert len(inspect.signature(build_app).parameters) == 1


ITEM = {"type": "image", "image": "QUJD"}


@pytest.mark.parametrize(
    "body,message",
    [
        ([], "must be a JSON object"),
        ({}, "items: Field required"),
        ({"items": []}, "items: List should have at least 1 item"),
        ({"items": [ITEM], "receive_count": "2"}, "receive_count"),
        ({"items": [ITEM], "receive_count": 0}, "receive_count"),
        ({"items": [ITEM], "wait": "yes"}, "wait"),
        ({"items": [ITEM], "req_id": "a/b"}, "req_id"),
        ({"items": [{"type": "image_url", "image_url": {}}]}, "items.0.image_url.image_url.url"),
        ({"items": [ITEM], "extra": 1}, "extra: Extra inputs"),
    ],
)
def test_encode_request_validation(body, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_encode_request(body)


def test_encode_request_defaults():
    req = parse_encode_request({"items": [ITEM]})
    assert req.req_id is None and req.receive_count is None and req.wait is True


def test_the_family_table_in_the_docs_is_the_one_the_config_uses():
    from encoder.spec import FAMILY_TABLE, families_markdown

    assert families_markdown() in (ROOT / "docs" / "models.md").read_text()
    with pytest.raises(ValueError, match="unknown model family 'qwen9'"):
        AppConfig(model={"family": "qwen9"})
    for row in FAMILY_TABLE:
        assert AppConfig(model={"family": row.name}).model.family == row.name
