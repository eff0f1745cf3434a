"""What the light processes import: the Ingress and the registry never load torch, and a
decoder rank that only fetches never loads Ray Serve."""

import dataclasses
import pathlib
import subprocess
import sys

from encoder import FAMILIES


def _fresh(code: str, timeout: int = 120) -> str:
    """What ``code`` prints in a fresh interpreter (this test process has torch, Ray and
    more loaded by other tests)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=timeout)
    return out.stdout.strip()


def test_ingress_and_registry_modules_do_not_import_torch():
    code = (
        "import sys, deployments, deployments.ingress, registry, registry.server.actor, encoder; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    assert _fresh(code) == "[]"


_CLIENT_PACKAGES = ("registry/client", "registry/engines")
_SERVER_ONLY = ("registry.server", "deployments", "ray.serve", "fastapi", "starlette")


def _imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, at any depth (inside functions too)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_client_or_engine_module_imports_the_server_side_or_serve():
    root = pathlib.Path(__file__).resolve().parents[2]
    modules = [path for package in _CLIENT_PACKAGES for path in sorted((root / package).rglob("*.py"))]
    assert len(modules) >= 8, modules  # the packages are where this test looks
    offending = {
        str(path.relative_to(root)): sorted(name for name in _imports(path) if name.startswith(_SERVER_ONLY))
        for path in modules
    }
    assert {path: names for path, names in offending.items() if names} == {}


def test_the_shared_core_imports_no_side():
    root = pathlib.Path(__file__).resolve().parents[2]
    core = sorted((root / "registry").glob("*.py"))
    sides = ("registry.server", "registry.client", "registry.engines")
    offending = {str(path.relative_to(root)): sorted(n for n in _imports(path) if n.startswith(sides)) for path in core}
    # The package's lazy exports and the connector's public path point into the sides.
    allowed = {"registry/__init__.py", "registry/vllm_connector.py"}
    assert {path: names for path, names in offending.items() if names and path not in allowed} == {}


def test_a_decoder_rank_importing_the_receiver_does_not_load_serve():
    code = (
        "import sys; from registry import EmbeddingReceiver, lookup_registry; "
        "print(sorted(m for m in sys.modules if m.startswith(('ray.serve', 'fastapi', 'registry.server'))))"
    )
    assert _fresh(code) == "[]"


def test_model_parts_still_load_on_first_use():
    import importlib

    import encoder
    from encoder.spec import FAMILY_TABLE

    for row in FAMILY_TABLE:  # every family name the config accepts names a module that builds it
        module = importlib.import_module(row.module)
        assert callable(module.build) and dataclasses.is_dataclass(module.OPTIONS), row
    assert [row.name for row in FAMILY_TABLE] == list(FAMILIES)
    assert encoder.build_encoder.__module__ == "encoder.loader"
    assert encoder.VisionEncoder.__module__ == "encoder.base"


def test_the_vllm_connector_loads_no_model_stack_and_no_serve():
    # What a vLLM engine process imports of this project: the connector and the receiver.
    # (vLLM itself imports transformers' auto classes; the vision towers are the encoder's.)
    code = (
        "import os, sys; os.environ['VLLM_TARGET_DEVICE'] = 'cpu'; "
        "import registry.vllm_connector, registry.client.receiver; "
        "print(sorted(m for m in sys.modules if m in ('encoder.base', 'encoder.loader', 'encoder.qwen_vl', "
        "'encoder.llava', 'encoder.tiny_vit', 'deployments', 'ray.serve', 'fastapi', "
        "'transformers.models.qwen2_5_vl.modeling_qwen2_5_vl', 'transformers.models.qwen2_vl.modeling_qwen2_vl', "
        "'transformers.models.clip.modeling_clip', 'transformers.models.siglip.modeling_siglip')))"
    )
    assert _fresh(code, timeout=180).splitlines()[-1] == "[]"  # vLLM logs to stdout before it


def test_our_requirements_admit_the_versions_vllm_pins():
    """Installable into a vLLM 0.33 environment as it is: for every package both require, some
    version satisfies both (checked at the versions either specifier names)."""
    import importlib.metadata
    import re

    from packaging.requirements import Requirement
    from packaging.version import Version

    def requirements(dist):
        reqs = (Requirement(r) for r in importlib.metadata.requires(dist) or ())
        return {r.name.lower(): r.specifier for r in reqs if r.marker is None or "extra" not in str(r.marker)}

    ours, vllm = requirements("epd-encoder"), requirements("vllm")
    shared = sorted(set(ours) & set(vllm))
    assert {"torch", "transformers", "pydantic", "fastapi"} <= set(shared)
    for name in shared:
        both = ours[name] & vllm[name]
        named = {Version(v) for s in both for v in re.findall(r"\d+(?:\.\d+)*", s.version)}
        candidates = named | {Version(f"{v.major}.{v.minor}.{v.micro + 1}") for v in named}
        assert any(both.contains(v) for v in candidates) or not named, f"{name}: ours {ours[name]}, vLLM's {vllm[name]}"


def test_the_zmq_receiver_imports_no_ray():
    # A decoder rank outside the cluster: pyzmq, numpy and torch only.
    code = (
        "import sys; from registry.client.zmq_receiver import ZmqEmbeddingReceiver; import registry; registry.ReceivedItem; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'fastapi', 'httpx', 'transformers', 'encoder'}))"
    )
    assert _fresh(code) == "[]"
