"""serve_config.vllm.yaml, the whole E+PD stack, checked against the schemas it uses.

It needs GPUs to run, so CI validates it instead: Serve's config schema, each
application's own args model (ours, and ray.serve.llm's LLMServingArgs), vLLM's
engine arguments and ECTransferConfig, and vLLM's connector factory resolving
the connector it names to ours.
"""

import pathlib

import pytest
import yaml

import vllm_env  # noqa: F401 - before vLLM: the CPU platform

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def config():
    return yaml.safe_load((ROOT / "serve_config.vllm.yaml").read_text())


def apps(config):
    return {app["name"]: app for app in config["applications"]}


def test_the_file_is_a_valid_serve_config_of_three_applications(config):
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(config)
    assert set(apps(config)) == {"epd", "llm", "epd-proxy"}


def test_each_application_s_args_validate_against_its_own_model(config):
    from ray.serve.llm import LLMServingArgs

    from deployments import AppConfig, ProxyConfig

    by_name = apps(config)
    epd = AppConfig.model_validate(by_name["epd"]["args"])
    proxy = ProxyConfig.model_validate(by_name["epd-proxy"]["args"])
    llm = LLMServingArgs.model_validate(by_name["llm"]["args"]).llm_configs[0]
    engine = llm.engine_kwargs
    # One TP size everywhere: the proxy stages each item for every rank of the engine.
    assert engine["tensor_parallel_size"] == proxy.tensor_parallel_size == epd.default_receive_count == 2
    assert engine["distributed_executor_backend"] == "ray"
    # The proxy forwards to the engine's app, and stages into the encoder app it names.
    assert proxy.vllm_url.endswith(by_name["llm"]["route_prefix"])
    assert proxy.encoder_app == "epd"
    extra = engine["ec_transfer_config"]["ec_connector_extra_config"]
    assert (extra["registry_name"], extra["registry_namespace"]) == (epd.registry_name, epd.registry_namespace)


def test_vllm_accepts_the_engine_args_and_its_factory_loads_our_connector(config):
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.engine.arg_utils import AsyncEngineArgs

    from registry.vllm_connector import RayRegistryECConnector

    engine = apps(config)["llm"]["args"]["llm_configs"][0]["engine_kwargs"]
    AsyncEngineArgs(model="/models/Qwen2.5-VL-7B-Instruct", **engine)  # unknown keys raise TypeError
    transfer = ECTransferConfig(**engine["ec_transfer_config"])
    assert transfer.is_ec_consumer and not transfer.is_ec_producer
    assert ECConnectorFactory.get_connector_class(transfer) is RayRegistryECConnector
