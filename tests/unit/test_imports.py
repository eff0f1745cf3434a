"""What the light processes import: the Ingress and the registry never load torch, and a
decoder rank that only fetches never loads Ray Serve."""

import subprocess
import sys

from encoder import FAMILIES


def test_ingress_and_registry_modules_do_not_import_torch():
    # A fresh interpreter: this test process has torch loaded by other tests.
    code = (
        "import sys, deployments, deployments.ingress, registry, registry.actor, encoder; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_decoder_rank_importing_the_receiver_does_not_load_serve():
    code = (
        "import sys; from registry import EmbeddingReceiver, lookup_registry; "
        "print(sorted(m for m in ('ray.serve', 'fastapi', 'registry.actor') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_model_parts_still_load_on_first_use():
    import encoder
    from encoder.loader import _FAMILIES

    assert set(_FAMILIES) == set(FAMILIES)  # every family name the config accepts can be built
    assert encoder.build_encoder.__module__ == "encoder.loader"
    assert encoder.VisionEncoder.__module__ == "encoder.base"
