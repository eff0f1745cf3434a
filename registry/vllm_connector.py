"""The path vLLM's ``--ec-transfer-config`` names: ``"ec_connector_module_path":
"registry.vllm_connector"``. The connector lives in ``registry.engines.vllm``; this module
keeps its public path stable."""

from registry.engines.vllm.connector import (
    ConnectorSettings,
    ItemLoad,
    RayRegistryECConnector,
    RayRegistryECMetadata,
    RayRegistryECWorkerMetadata,
)

__all__ = ["ConnectorSettings", "ItemLoad", "RayRegistryECConnector", "RayRegistryECMetadata", "RayRegistryECWorkerMetadata"]
