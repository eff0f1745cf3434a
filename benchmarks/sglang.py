"""The SGLang protocol beside SGLang's own encoder server: ``python -m benchmarks.sglang``.

Both encoders serve SGLang 0.5.23's own language-side code (``tests/sglang_ranks.py`` in its
venv: the tokenizer's ``/encode`` dispatch and two TP ranks, ``zmq_to_scheduler``), one image
per request: ``service`` (this project's ``/sglang`` routes, the stand-in encoder) and
``sglang`` (``tests/sglang_encoder_server.py``, its encode step a fixed tensor). Per size, one
run of the ranks alternates requests between them (A B B A ...); per request, the time from
``/encode`` to the second rank holding the embedding; per encoder, its processes' CPU per
request less their idle CPU over the same time. Prints medians and service / sglang ratios.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import tempfile
import time
from typing import Any, Iterator

from ray import serve

from benchmarks import standin
from benchmarks.cluster import REPO_ROOT, CpuMeter, free_port, local_cluster, run_token, start_serve, tests_module
from benchmarks.report import parse_args

SIZES = (32 * 8192, 576 * 8192, 2304 * 8192)  # 0.26, 4.72 and 18.87 MB
TARGETS = ("service", "sglang")
_IDLE_S = 3.0
_ROLES = {f"ServeReplica:{standin.APP}:": "service", "EmbeddingRegistry": "service", "ProxyActor": "service"}


@contextlib.contextmanager
def sglang_server(python: str, env: dict[str, str], nbytes: int) -> Iterator[tuple[str, int]]:
    """SGLang's own encoder server answering a fixed ``nbytes`` embedding: (its URL, its pid)."""
    port = free_port()
    proc = subprocess.Popen(
        [python, str(REPO_ROOT / "tests" / "sglang_encoder_server.py"), "--port", str(port), "--tokens",
         str(nbytes // (standin.WIDTH * 2)), "--hidden", str(standin.WIDTH), "--dtype", "bfloat16"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        if not any(line.startswith("{") and json.loads(line).get("ready") for line in proc.stdout):
            raise RuntimeError(f"SGLang's encoder server exited with {proc.wait()} before it was ready")
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def _run_ranks(python: str, env: dict[str, str], requests: list[dict], workdir: pathlib.Path) -> dict[str, Any]:
    (workdir / "requests.json").write_text(json.dumps(requests))
    out = workdir / "results.json"
    subprocess.run(
        [python, str(REPO_ROOT / "tests" / "sglang_ranks.py"), "--encoder-url", requests[0]["encoder_url"],
         "--backend", "zmq_to_scheduler", "--tp", "2", "--requests", str(workdir / "requests.json"), "--out", str(out)],
        cwd=REPO_ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    results = json.loads(out.read_text())
    if results["harness_error"]:
        raise RuntimeError(f"the SGLang ranks failed: {results['harness_error']}")
    return results


def measure_size(python: str, env: dict[str, str], urls: dict[str, str], pid: int, nbytes: int,
                 requests: int, workdir: pathlib.Path) -> dict[str, float | None]:
    """One size: ``requests`` per encoder, alternating; medians and CPU per request."""
    order = [TARGETS[(i // 2 + i) % 2] for i in range(2 * requests)]  # A B B A A B ...
    image = "data:image/png;base64,{}".format
    batch = [{"rid": f"bench-{nbytes}-{i}-{target}", "encoder_url": urls[target], "parts": 1,
              "images": [image(base64.b64encode(standin.image_media(nbytes, seed=i)).decode())]}
             for i, target in enumerate(order)]
    _run_ranks(python, env, [dict(request, rid=f"warm-{request['rid']}") for request in batch[:4]], workdir)  # warm-up
    with CpuMeter(_ROLES, {pid: "sglang"}) as idle:
        time.sleep(_IDLE_S)
    started = time.monotonic()
    with CpuMeter(_ROLES, {pid: "sglang"}) as busy:
        results = _run_ranks(python, env, batch, workdir)
    wall = time.monotonic() - started
    held: dict[str, list[float]] = {target: [] for target in TARGETS}
    for request, target in zip(results["requests"], order, strict=True):
        if not request["all_admitted"]:
            raise RuntimeError(f"request {request['rid']} was not admitted: {request}")
        held[target].append(max(rank["held_s"] for rank in request["ranks"]))
    out: dict[str, float | None] = {}
    for target in TARGETS:
        spent = busy.by_role.get(target, 0.0) - idle.by_role.get(target, 0.0) * wall / _IDLE_S
        out[f"{target}_ms"] = round(statistics.median(held[target]) * 1e3, 3)
        out[f"{target}_cpu_ms"] = round(spent * 1e3 / requests, 3)
    out["time_ratio"] = round(out["service_ms"] / out["sglang_ms"], 2)
    out["cpu_ratio"] = round(out["service_cpu_ms"] / out["sglang_cpu_ms"], 2) if out["sglang_cpu_ms"] > 0 else None
    return out


def run(requests: int, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    sglang_env = tests_module("sglang_env")  # builds (once) and finds SGLang's venv
    python, env = sglang_env.ensure_sglang_python(), sglang_env.script_env()
    out: dict[str, Any] = {}
    token = run_token()
    with local_cluster(f"epd-sglang-{token}") as cluster, tempfile.TemporaryDirectory() as tmp:
        http_url = start_serve()["http_url"]
        app = standin.application(sizes, f"sglang_{token}", cluster["namespace"])
        serve.run(app, name=standin.APP, route_prefix=f"/{standin.APP}")
        for nbytes in sizes:
            with sglang_server(python, env, nbytes) as (sglang_url, pid):
                urls = {"service": f"{http_url}/{standin.APP}/sglang", "sglang": sglang_url}
                out[f"{nbytes / 1e6:.2f}MB"] = measure_size(python, env, urls, pid, nbytes, requests, pathlib.Path(tmp))
    return out


def main() -> None:
    args = parse_args(
        __doc__,
        requests=dict(type=int, default=20, help="requests per encoder and size (default 20)"),
        sizes=dict(type=float, nargs="+", default=[n / 1e6 for n in SIZES],
                   help="embedding MB per image (default 0.26 4.72 18.87), rounded to whole 8 KB rows"),
    )
    row = standin.WIDTH * 2
    sizes = tuple(max(1, round(mb * 1e6 / row)) * row for mb in args.sizes)
    report = {"sizes": run(args.requests, sizes), "settings": {**vars(args), "tp": 2, "cpus": os.cpu_count()}}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
