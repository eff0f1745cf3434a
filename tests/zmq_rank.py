"""A decoder TP rank in a plain Python process (no Ray), driven by a test over stdin/stdout.

Run as ``python tests/zmq_rank.py <url> <rank> <api_token>`` from the repository
root. It prints ``{"endpoint": ...}`` once bound, then answers each JSON command
line with one JSON line:

* ``{"op": "fetch", "req_id", "timeout_s"}``: ``ZmqEmbeddingReceiver.fetch``; the
  items' dtypes, shapes, metas and sha256 of their raw bytes, or the error;
* ``{"op": "acknowledge", "req_id"}``: ``ZmqEmbeddingReceiver.acknowledge``;
* ``{"op": "register", "req_id"}``: a push registration whose items are received
  and never acknowledged (a rank that dies between the two);
* ``{"op": "modules"}``: whether Ray was ever imported here.
"""

import hashlib
import json
import sys

import torch

from registry.errors import RegistryError
from registry.client.zmq_receiver import ZmqEmbeddingReceiver


def _raw(tensor: torch.Tensor) -> bytes:
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def _run(rx: ZmqEmbeddingReceiver, command: dict) -> dict:
    op, req_id = command["op"], command.get("req_id", "")
    if op == "fetch":
        items = rx.fetch(req_id, timeout_s=command.get("timeout_s", 30.0))
        return {
            "metas": [item.meta for item in items],
            "dtypes": [str(item.tensor.dtype).removeprefix("torch.") for item in items],
            "shapes": [list(item.tensor.shape) for item in items],
            "digests": [hashlib.sha256(_raw(item.tensor)).hexdigest() for item in items],
        }
    if op == "acknowledge":
        return {"released": rx.acknowledge(req_id)}
    if op == "register":
        pushed = rx._post(req_id, "push", {"rank": rx.rank, "endpoint": rx.endpoint, "timeout_s": 10.0})
        items = rx._collect(req_id, pushed["delivery"], pushed["items"])
        return {"received": None if items is None else len(items)}
    if op == "modules":
        return {"ray": any(name == "ray" or name.startswith("ray.") for name in sys.modules)}
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    url, rank, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with ZmqEmbeddingReceiver(rank=rank, url=url, api_token=token) as rx:
        print(json.dumps({"endpoint": rx.endpoint}), flush=True)
        for line in sys.stdin:
            try:
                answer = _run(rx, json.loads(line))
            except RegistryError as exc:
                answer = {"error": exc.code, "message": exc.message, "details": exc.details}
            print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
