"""Serving real checkpoints: embeddings fetched by TP ranks drive the LM to the monolithic logits."""

import numpy as np
import pytest
import ray
import torch
from ray import serve

from deployments import compose_app
from models import (
    llava_logits_from_embeddings,
    llava_prompt,
    qwen_logits_from_embeddings,
    qwen_prompt,
    qwen_video_reference_pixels,
    save_llava,
    save_qwen2_5_vl,
)
from registry import lookup_registry
from support import DRAIN, RankActor, data_url, deployed, image_bytes, image_item, one_thread

IMAGES = [image_bytes(150, 100, seed=51), image_bytes(96, 64, seed=52)]
NAMESPACE = "epd-tests"


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    """Two more apps on the shared cluster, each serving a checkpoint saved to a temporary directory."""
    models, targets = {}, []
    cpu_free = {"ray_actor_options": {"num_cpus": 0}, **DRAIN}
    for name, family, prefix, save in (
        ("epd-qwen", "qwen2_5_vl", "/qwen", save_qwen2_5_vl),
        ("epd-llava", "llava", "/llava", save_llava),
    ):
        path = str(tmp_path_factory.mktemp(name))
        model = save(path)
        args = {
            "registry_name": f"{name}_registry", "registry_namespace": NAMESPACE, "default_receive_count": 2,
            "model": {"family": family, "path": path, "dtype": "float32"},
        }
        app = compose_app(args, deployment_options={"Encoder": cpu_free, "Ingress": cpu_free})
        targets.append(serve.RunTarget(app, name=name, route_prefix=prefix))
        models[name] = (model, prefix, [RankActor.remote(r, f"{name}_registry", NAMESPACE) for r in range(2)], path)
    with deployed(*targets):
        yield models
    for name in models:
        ray.kill(lookup_registry(f"{name}_registry", NAMESPACE))


def encode_and_fetch(cluster, prefix, ranks):
    body = {"receive_count": 2, "items": [image_item(d) for d in IMAGES]}
    response = cluster.http.post(f"{prefix}/v1/encode", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    results = ray.get([rank.fetch.remote(out["req_id"]) for rank in ranks])
    assert all("error" not in r for r in results), results
    assert results[0]["bytes"] == results[1]["bytes"]  # every rank, the same bits
    tensors = [
        torch.from_numpy(np.frombuffer(raw, dtype=np.float32).reshape(shape).copy())
        for raw, shape in zip(results[0]["bytes"], results[0]["shapes"])
    ]
    assert cluster.http.get(f"{prefix}/v1/requests/{out['req_id']}").json()["state"] == "released"
    return out, tensors


def test_qwen2_5_vl_checkpoint_served_embeddings_give_monolithic_logits(cluster, served):
    model, prefix, ranks, path = served["epd-qwen"]
    health = cluster.http.get(f"{prefix}/health").json()
    assert health["encoder"]["family"] == "qwen2_5_vl" and health["encoder"]["torch_threads"] == 1
    out, embeddings = encode_and_fetch(cluster, prefix, ranks)
    grid = torch.tensor([item["grid_thw"] for item in out["items"]])
    assert [e.shape[0] for e in embeddings] == (grid.prod(-1) // 4).tolist()

    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    pixels = processor(images=[_pil(d) for d in IMAGES], return_tensors="pt")
    assert torch.equal(pixels["image_grid_thw"], grid)
    input_ids = qwen_prompt([e.shape[0] for e in embeddings])
    with torch.no_grad(), one_thread():  # the replica runs on one thread (asserted above)
        features = model.get_image_features(pixels["pixel_values"], grid).pooler_output
        monolithic = model(input_ids=input_ids, pixel_values=pixels["pixel_values"], image_grid_thw=grid,
                           mm_token_type_ids=(input_ids == 999).int()).logits
        disaggregated = qwen_logits_from_embeddings(model, input_ids, embeddings, grid)
    # Bitwise in float32 on one CPU thread; stated tolerance for the logits: exact as well.
    assert all(torch.equal(a, b) for a, b in zip(embeddings, features))
    torch.testing.assert_close(disaggregated, monolithic, rtol=0, atol=0)


def test_llava_clip_checkpoint_served_embeddings_give_monolithic_logits(cluster, served):
    model, prefix, ranks, path = served["epd-llava"]
    assert cluster.http.get(f"{prefix}/health").json()["encoder"]["torch_threads"] == 1
    _, embeddings = encode_and_fetch(cluster, prefix, ranks)

    from transformers.models.clip import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil.from_pretrained(path)
    pixels = processor(images=[_pil(d) for d in IMAGES], return_tensors="pt")["pixel_values"]
    input_ids = llava_prompt([e.shape[0] for e in embeddings])
    with torch.no_grad(), one_thread():
        features = model.get_image_features(pixels, vision_feature_layer=-2,
                                            vision_feature_select_strategy="default").pooler_output
        monolithic = model(input_ids=input_ids, pixel_values=pixels).logits
        disaggregated = llava_logits_from_embeddings(model, input_ids, embeddings)
    assert all(torch.equal(a, b) for a, b in zip(embeddings, features))
    torch.testing.assert_close(disaggregated, monolithic, rtol=0, atol=0)


def test_qwen_video_item_served_equals_the_models_video_features(cluster, served):
    model, prefix, ranks, path = served["epd-qwen"]
    frames = [image_bytes(150, 100, seed=s) for s in (81, 82, 83)]
    body = {"receive_count": 2, "items": [{"type": "video", "video": [data_url(f) for f in frames]}, image_item(IMAGES[0])]}
    response = cluster.http.post(f"{prefix}/v1/encode", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["items"][0]["frames"] == 3 and out["items"][0]["grid_thw"][0] == 2  # 3 frames, padded to 2 groups
    results = ray.get([rank.fetch.remote(out["req_id"]) for rank in ranks])
    assert results[0]["bytes"] == results[1]["bytes"]
    video = torch.from_numpy(np.frombuffer(results[0]["bytes"][0], dtype=np.float32).reshape(results[0]["shapes"][0]).copy())

    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    pixels, grid = qwen_video_reference_pixels(Qwen2VLImageProcessorPil.from_pretrained(path), [_pil(f) for f in frames])
    assert grid == out["items"][0]["grid_thw"]
    with torch.no_grad(), one_thread():
        reference = model.get_video_features(pixels, torch.tensor([grid])).pooler_output[0]
    assert torch.equal(video, reference)


def _pil(data):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")
