"""The SGLang protocol beside SGLang's own encoder server: ``python -m benchmarks.sglang``.

Both encoders serve the same SGLang 0.5.23 language-side code (``tests/sglang_ranks.py``
in SGLang's own venv: its tokenizer-side ``/encode`` dispatch and two scheduler TP ranks
in one gloo group, ``zmq_to_scheduler``), one image per request, with an embedding of
0.26, 4.7 and 19 MB (bfloat16, 4096 wide):

* ``service``: this project's Ingress and registry with the stand-in encoder
  (``benchmarks/standin.py``, a forward pass that costs nothing), at ``/sglang``;
* ``sglang``: SGLang's own encoder ``http_server`` (``tests/sglang_encoder_server.py``),
  its encode step replaced by a fixed tensor of the same size.

For each size, after a warm-up run, one run of the ranks sends requests one at a time,
alternating between the two encoders (A B B A ...), so both see the same machine. Per request: the time from
the tokenizer-side dispatch of ``/encode`` to the second rank holding the embedding. Per
encoder: the CPU its processes spend per request (service: Serve's proxy, the Ingress,
the registry, the encoder replica; sglang: its server process), over the run, less what
they spend idle over the same time (measured just before). Prints one JSON object of
medians and ratios (service / sglang; below 1 is better).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

from benchmarks import standin
from benchmarks.cluster import free_port
from benchmarks.cpu import CpuMeter, by_title
from benchmarks.scale_out import QUIET_SIZES

REPO = pathlib.Path(__file__).resolve().parents[1]
TARGETS = ("service", "sglang")
_IDLE_S = 3.0


def _sglang_env() -> Any:
    """``tests/sglang_env.py``, which builds (once) and finds SGLang's venv."""
    sys.path.insert(0, str(REPO / "tests"))
    import sglang_env

    return sglang_env


@contextlib.contextmanager
def sglang_server(python: str, env: dict[str, str], nbytes: int) -> Iterator[tuple[str, int]]:
    """SGLang's own encoder server answering a fixed ``nbytes`` embedding: (its URL, its pid)."""
    port = free_port()
    proc = subprocess.Popen(
        [python, str(REPO / "tests" / "sglang_encoder_server.py"), "--port", str(port), "--tokens",
         str(nbytes // (standin.WIDTH * 2)), "--hidden", str(standin.WIDTH), "--dtype", "bfloat16"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("{") and json.loads(line).get("ready"):
                break
        else:
            raise RuntimeError(f"SGLang's encoder server exited with {proc.wait()} before it was ready")
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def _run_ranks(python: str, env: dict[str, str], requests: list[dict], workdir: pathlib.Path) -> dict[str, Any]:
    (workdir / "requests.json").write_text(json.dumps(requests))
    out = workdir / "results.json"
    subprocess.run(
        [python, str(REPO / "tests" / "sglang_ranks.py"), "--encoder-url", requests[0]["encoder_url"],
         "--backend", "zmq_to_scheduler", "--tp", "2", "--requests", str(workdir / "requests.json"), "--out", str(out)],
        cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    results = json.loads(out.read_text())
    if results["harness_error"]:
        raise RuntimeError(f"the SGLang ranks failed: {results['harness_error']}")
    return results


def measure_size(python: str, env: dict[str, str], urls: dict[str, str], classify: Any, nbytes: int,
                 requests: int, workdir: pathlib.Path) -> dict[str, float]:
    """One size: ``requests`` per encoder, alternating; medians and CPU per request."""
    order = [TARGETS[(i // 2 + i) % 2] for i in range(2 * requests)]  # A B B A A B ...
    batch = [
        {"rid": f"bench-{nbytes}-{i}-{target}", "encoder_url": urls[target], "parts": 1,
         "images": [_data_url(standin.image_media(nbytes, seed=i))]}
        for i, target in enumerate(order)
    ]
    warmup = [dict(request, rid=f"warm-{request['rid']}") for request in batch[:4]]  # both encoders' first calls
    _run_ranks(python, env, warmup, workdir)
    with CpuMeter(classify) as idle:
        time.sleep(_IDLE_S)
    started = time.monotonic()
    with CpuMeter(classify) as busy:
        results = _run_ranks(python, env, batch, workdir)
    wall = time.monotonic() - started
    held: dict[str, list[float]] = {target: [] for target in TARGETS}
    for request, target in zip(results["requests"], order, strict=True):
        if not request["all_admitted"]:
            raise RuntimeError(f"request {request['rid']} was not admitted: {request}")
        held[target].append(max(rank["held_s"] for rank in request["ranks"]))
    out: dict[str, float] = {}
    for target in TARGETS:
        spent = busy.by_role.get(target, 0.0) - idle.by_role.get(target, 0.0) * wall / _IDLE_S
        out[f"{target}_ms"] = round(statistics.median(held[target]) * 1e3, 3)
        out[f"{target}_cpu_ms"] = round(spent * 1e3 / requests, 3)
    out["time_ratio"] = round(out["service_ms"] / out["sglang_ms"], 2)
    out["cpu_ratio"] = round(out["service_cpu_ms"] / out["sglang_cpu_ms"], 2) if out["sglang_cpu_ms"] > 0 else None
    return out


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def run(requests: int, sizes: tuple[int, ...] = QUIET_SIZES) -> dict[str, Any]:
    sglang_env = _sglang_env()
    python = sglang_env.ensure_sglang_python()
    env = sglang_env.script_env()
    out: dict[str, Any] = {}
    with standin.served_alone("sglang", sizes) as served, tempfile.TemporaryDirectory() as tmp:
        service_url = f"{served['http_url']}/{standin.APP}/sglang"
        for nbytes in sizes:
            with sglang_server(python, env, nbytes) as (sglang_url, pid):
                classify = by_title(
                    {f"ServeReplica:{standin.APP}:": "service", "EmbeddingRegistry": "service", "ProxyActor": "service"},
                    {pid: "sglang"},
                )
                urls = {"service": service_url, "sglang": sglang_url}
                out[f"{nbytes / 1e6:.2f}MB"] = measure_size(python, env, urls, classify, nbytes, requests, pathlib.Path(tmp))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20, help="requests per encoder and size (default 20)")
    parser.add_argument("--sizes", type=float, nargs="+", default=[n / 1e6 for n in QUIET_SIZES],
                        help="embedding MB per image (default 0.26 4.72 18.87), rounded to whole 8 KB rows")
    args = parser.parse_args()
    row = standin.WIDTH * 2
    sizes = tuple(max(1, round(mb * 1e6 / row)) * row for mb in args.sizes)
    report = {"sizes": run(args.requests, sizes), "settings": {**vars(args), "tp": 2, "cpus": os.cpu_count()}}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
