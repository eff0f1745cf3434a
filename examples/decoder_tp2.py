"""A TP=2 decoder stub: two rank actors fetch the embeddings of one encoded request.

Run it next to a running service (``serve run serve_config.yaml``)::

    python examples/decoder_tp2.py --url http://127.0.0.1:8000

It posts one image with ``receive_count: 2`` over HTTP, then each rank actor
fetches the embeddings with ``EmbeddingReceiver`` as a prefill engine's TP
ranks would, and prints what each got as JSON. The entry is released after
the second rank's fetch.

``--req-id ID --ranks 1`` instead fetches a request encoded earlier, as rank 1
only: ranks of one request may live in different processes.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import ray
import torch
from demo_request import demo_image, post_encode  # next to this file


@ray.remote(num_cpus=0)
class DecoderRank:
    """One tensor-parallel rank of a (stub) language model."""

    def __init__(self, rank: int):
        from registry import EmbeddingReceiver

        self.receiver = EmbeddingReceiver(rank=rank)

    async def prefill(self, req_id: str) -> dict:
        items = await self.receiver.fetch_async(req_id, timeout_s=30.0)
        # A real engine would scatter item.tensor into its input embeddings here.
        return {
            "rank": self.receiver.rank,
            # Inline, not demo_request.summary: this runs in a Ray worker, which cannot import
            # the files next to this script.
            "items": [
                {
                    "index": item.meta["index"],
                    "shape": list(item.tensor.shape),
                    "dtype": str(item.tensor.dtype).removeprefix("torch."),
                    "sha256": hashlib.sha256(item.tensor.view(torch.uint8).numpy().tobytes()).hexdigest(),
                }
                for item in items
            ],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the epd service")
    parser.add_argument("--address", default="auto", help="Ray cluster address (default: the local one)")
    parser.add_argument("--req-id", help="fetch this request (encoded earlier) instead of encoding one")
    parser.add_argument("--ranks", default="0,1", help="the ranks to run here, comma-separated (default: 0,1)")
    args = parser.parse_args()

    ray.init(address=args.address)
    if args.req_id is None:
        staged = post_encode(args.url, demo_image(), receive_count=2)
        req_id, encoded = staged["req_id"], staged["items"]
    else:
        req_id, encoded = args.req_id, None
    ranks = [DecoderRank.remote(int(r)) for r in args.ranks.split(",")]
    results = ray.get([rank.prefill.remote(req_id) for rank in ranks])
    print(json.dumps({"req_id": req_id, "encoded": encoded, "ranks": results}))


if __name__ == "__main__":
    main()
