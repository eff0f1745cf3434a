"""serve_config.vllm.yaml (GPU) and serve_config.vllm.cpu.yaml (CPU), the whole E+PD stack,
checked against the schemas they use.

The GPU file needs GPUs to run, so CI validates it instead; the CPU file also runs in CI
(tests/e2e/test_vllm_stack.py). Both are checked here against Serve's config schema, each
application's own args model (ours, and ray.serve.llm's LLMServingArgs), vLLM's engine
arguments and ECTransferConfig, and vLLM's connector factory resolving the connector
they name to ours.
"""

import pathlib

import pytest
import yaml

import vllm_env  # noqa: F401 - before vLLM: the CPU platform

ROOT = pathlib.Path(__file__).resolve().parents[2]
# file -> (the engine's TP size, the accelerator Ray Serve LLM places it on)
STACKS = {"serve_config.vllm.yaml": (2, "gpu"), "serve_config.vllm.cpu.yaml": (1, "cpu")}


@pytest.fixture(params=list(STACKS))
def stack(request):
    return request.param, yaml.safe_load((ROOT / request.param).read_text())


def apps(config):
    return {app["name"]: app for app in config["applications"]}


def test_the_file_is_a_valid_serve_config_of_three_applications(stack):
    from ray.serve.schema import ServeDeploySchema

    _, config = stack
    ServeDeploySchema.model_validate(config)
    assert set(apps(config)) == {"epd", "llm", "epd-proxy"}


def test_each_application_s_args_validate_against_its_own_model(stack):
    from ray.serve.llm import LLMServingArgs

    from deployments import AppConfig, ProxyConfig

    name, config = stack
    tp, accelerator = STACKS[name]
    by_name = apps(config)
    epd = AppConfig.model_validate(by_name["epd"]["args"])
    proxy = ProxyConfig.model_validate(by_name["epd-proxy"]["args"])
    llm = LLMServingArgs.model_validate(by_name["llm"]["args"]).llm_configs[0]
    engine = llm.engine_kwargs
    # One TP size everywhere: the proxy stages each item for every rank of the engine.
    assert engine["tensor_parallel_size"] == proxy.tensor_parallel_size == epd.default_receive_count == tp
    # On GPUs the ray backend; on CPU Ray Serve LLM runs vLLM's mp backend itself.
    assert llm.accelerator_config.kind == accelerator
    assert engine.get("distributed_executor_backend") == ("ray" if accelerator == "gpu" else None)
    # The proxy forwards to the engine's app, and stages into the encoder app it names.
    assert proxy.vllm_url.endswith(by_name["llm"]["route_prefix"])
    assert proxy.encoder_app == "epd"
    extra = engine["ec_transfer_config"]["ec_connector_extra_config"]
    assert (extra["registry_name"], extra["registry_namespace"]) == (epd.registry_name, epd.registry_namespace)
    if accelerator == "cpu":  # the encoder computes in the engine's dtype, on the CPU
        assert (epd.model.dtype, epd.model.device, epd.model.path) == (engine["dtype"], "cpu", llm.model_loading_config.model_source)


def test_vllm_accepts_the_engine_args_and_its_factory_loads_our_connector(stack):
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.engine.arg_utils import AsyncEngineArgs

    from registry.vllm_connector import RayRegistryECConnector

    _, config = stack
    engine = apps(config)["llm"]["args"]["llm_configs"][0]["engine_kwargs"]
    AsyncEngineArgs(model="/models/Qwen2.5-VL-7B-Instruct", **engine)  # unknown keys raise TypeError
    transfer = ECTransferConfig(**engine["ec_transfer_config"])
    assert transfer.is_ec_consumer and not transfer.is_ec_producer
    assert ECConnectorFactory.get_connector_class(transfer) is RayRegistryECConnector
