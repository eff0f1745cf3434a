"""A TP=2 decoder over plain HTTP: two ranks pull one request's embeddings as safetensors.

Run it next to a running service (``serve run serve_config.yaml``), with any
HTTP client; no Ray, no ZMQ::

    python examples/decoder_http.py --url http://127.0.0.1:8000

It posts one image with ``receive_count: 2``, then each rank pulls
``GET /v1/requests/{req_id}/items?rank=N`` (which waits while the request is
pending), loads the file with ``safetensors.torch.load``, and acknowledges it with
``POST /v1/requests/{req_id}/acknowledge``: only then is the rank counted, so a pull
that failed mid-way could be repeated. It prints what each rank got as JSON. The
entry is released at the second acknowledgement.
"""

from __future__ import annotations

import argparse
import json
import urllib.request

import safetensors.torch
from demo_request import demo_image, headers, post_encode, summary  # next to this file


def prefill(url: str, req_id: str, rank: int) -> dict:
    request = urllib.request.Request(f"{url}/v1/requests/{req_id}/items?rank={rank}&timeout_s=30", headers=headers())
    with urllib.request.urlopen(request, timeout=60) as response:
        body = response.read()
    tensors = safetensors.torch.load(body)  # {"item_0": tensor, ...}, in the staged dtype
    # Read whole and loaded: count this rank now (else the service counts it http_pull_grace_s later).
    acknowledge = urllib.request.Request(f"{url}/v1/requests/{req_id}/acknowledge", headers=headers(),
                                         data=json.dumps({"rank": rank}).encode())
    with urllib.request.urlopen(acknowledge, timeout=60) as response:
        released = json.load(response)["released"]
    # Each item's metadata (mm_hash, shape, model fields) is JSON in the header's __metadata__.
    header = json.loads(body[8 : 8 + int.from_bytes(body[:8], "little")])["__metadata__"]
    metas = [json.loads(header[f"item_{i}"]) for i in range(len(tensors))]
    return {
        "rank": rank,
        "released": released,
        "items": [{**summary(meta["index"], tensors[f"item_{i}"]), "mm_hash": meta["mm_hash"]} for i, meta in enumerate(metas)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the epd service")
    args = parser.parse_args()

    staged = post_encode(args.url, demo_image(), receive_count=2)
    results = [prefill(args.url, staged["req_id"], rank) for rank in range(2)]
    print(json.dumps({"req_id": staged["req_id"], "encoded": staged["items"], "ranks": results}))


if __name__ == "__main__":
    main()
