"""A TP=2 decoder outside Ray: two ranks receive one request's embeddings over ZMQ.

Run it next to a running service (``serve run serve_config.yaml``), in any Python
environment with this project installed; it never joins the Ray cluster::

    python examples/decoder_zmq.py --url http://127.0.0.1:8000

It posts one image with ``receive_count: 2``, then each rank's
``ZmqEmbeddingReceiver`` binds a PULL socket, has the service push the items to it
and acknowledges them, and prints what each got as JSON. The entry is released
after the second rank's acknowledgement. (Ranks would be separate processes in an
engine; two receivers in one process show the same.) The service pushes only to
addresses inside its ``push_allowed_networks`` (default: loopback).
"""

from __future__ import annotations

import argparse
import json

from demo_request import demo_image, post_encode, summary  # next to this file

from registry.client.zmq_receiver import ZmqEmbeddingReceiver


def prefill(rx: ZmqEmbeddingReceiver, req_id: str) -> dict:
    items = rx.fetch(req_id, timeout_s=30.0)
    # A real engine would scatter item.tensor into its input embeddings here.
    return {
        "rank": rx.rank,
        "items": [summary(item.meta["index"], item.tensor) for item in items],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the epd service")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="where each rank's PULL socket listens")
    args = parser.parse_args()

    staged = post_encode(args.url, demo_image(), receive_count=2)
    receivers = [ZmqEmbeddingReceiver(rank=r, url=args.url, bind=args.bind) for r in range(2)]
    try:
        results = [prefill(rx, staged["req_id"]) for rx in receivers]
    finally:
        for rx in receivers:
            rx.close()
    print(json.dumps({"req_id": staged["req_id"], "encoded": staged["items"], "ranks": results}))


if __name__ == "__main__":
    main()
