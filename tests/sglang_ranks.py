"""SGLang 0.5.23's own language-side EPD receivers (TP ranks) against any encoder URL.

Run with the SGLang venv's python (``tests/sglang_env.py``), never imported by
pytest (it is not named ``test_*`` and does everything under ``__main__``)::

    python tests/sglang_ranks.py --encoder-url http://127.0.0.1:30100 --backend zmq_to_scheduler \\
        --tp 2 --requests requests.json --out results.json

``requests.json`` is a list of ``{"rid": str, "images": [data-URL strings], "parts": int}``;
``parts`` is how many ``/encode`` parts SGLang splits the images into (its
``encoder_urls`` list is the URL repeated ``parts`` times, so SGLang's own
``_assign_items_by_modality`` splits them; fewer images than parts give one part
per image). A request's optional ``"encoder_url"`` sends it to another encoder than
``--encoder-url`` (a benchmark alternates two encoders in one run).

Processes (forked after the SGLang imports, so they are paid once), each in its
own module next to this script (``tests/`` is ``sys.path[0]`` when it runs):

* the driver (``sglang_tokenizer_driver.py``) plays SGLang's tokenizer manager:
  its receiver dispatches each request's ``/encode`` and hands the request to TP
  rank 0;
* ``--tp`` rank processes (``sglang_scheduler_rank.py``) play the scheduler: a
  real gloo TP group on the CPU, each running SGLang's receiver (or, under
  ``zmq_to_tokenizer``, none) on what rank 0 broadcasts every tick;
* the multimodal processor both sides hand the embedding to is a stand-in
  (``sglang_recording.py``) that records what SGLang passes it.

This file holds the command line, the reading of ``requests.json`` and ``main``,
which starts the processes and writes ``results.json``.

``results.json``: per request, per rank: ``status`` (``admitted``/``aborted``/
``pending`` if the run was cut short), ``error_msg``, ``error_code``, per modality
``sha256`` (of the raw bytes), ``dtype``, ``shape``, ``nbytes``, ``img_grid_thw``
as a list, ``held_s`` (from just before the tokenizer-side dispatch to the moment
SGLang handed that rank the assembled embedding; one clock for all processes) and
``resolved_s`` (to the tick that admitted or aborted it on that rank), and
``cpu_s`` (that rank's CPU time from first seeing the request to resolving it:
meaningful with ``--concurrency 1``); per rank process: ``cpu_s`` over the run
(without the harness's own hashing, reported as ``hash_cpu_s``). Exit status 0
when every request was resolved (aborted requests are results), 2 when the
harness broke (bad input, a rank died, ``--timeout-s`` passed); results are
written in both cases.

Timing resolution: a rank consumes its socket on its tick; rank 0 wakes as soon
as its own socket or the driver has something, the other ranks follow it
through the broadcast, so their ``held_s`` can lag by up to ``--tick-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback

from sglang_recording import configure_logging
from sglang_scheduler_rank import rank_main
from sglang_tokenizer_driver import HarnessError, drive

BACKENDS = ("zmq_to_scheduler", "zmq_to_tokenizer")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="SGLang 0.5.23's own EPD receivers (TP ranks) against an encoder URL.")
    p.add_argument("--encoder-url", required=True, help="e.g. http://127.0.0.1:30100 (no trailing slash)")
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--requests", required=True, help="JSON list of {rid, images, parts}")
    p.add_argument("--out", required=True, help="where to write results.json")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (default 1)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="overall limit; past it the harness fails")
    p.add_argument("--recv-timeout-s", type=float, default=None,
                   help="SGLANG_ENCODER_RECV_TIMEOUT for the receivers (SGLang's default: 180)")
    p.add_argument("--tick-s", type=float, default=0.001, help="longest wait between scheduler ticks while waiting")
    p.add_argument("--ready-timeout-s", type=float, default=120.0, help="limit for the ranks to start")
    p.add_argument("--log-level", default="WARNING", help="SGLang's log level in all processes")
    return p.parse_args(argv)


def load_requests(path: str) -> list[dict]:
    try:
        with open(path) as f:
            requests = json.load(f)
    except (OSError, ValueError) as exc:
        raise HarnessError(f"cannot read --requests {path}: {exc}") from None
    if not isinstance(requests, list) or not requests:
        raise HarnessError("--requests must hold a non-empty JSON list")
    seen = set()
    for i, req in enumerate(requests):
        if not isinstance(req, dict):
            raise HarnessError(f"request {i} is not an object")
        rid, images, parts = req.get("rid"), req.get("images"), req.get("parts", 1)
        if not isinstance(rid, str) or not rid or "_local_part_" in rid:
            raise HarnessError(f"request {i}: rid must be a non-empty string without '_local_part_'")
        if rid in seen:
            raise HarnessError(f"request {i}: duplicate rid {rid!r}")
        seen.add(rid)
        if not isinstance(images, list) or not images or not all(isinstance(u, str) and u for u in images):
            raise HarnessError(f"request {rid}: images must be a non-empty list of URL strings")
        if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
            raise HarnessError(f"request {rid}: parts must be a positive integer")
        if not isinstance(req.get("encoder_url", ""), str):
            raise HarnessError(f"request {rid}: encoder_url must be a URL string")
    return requests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: where a hung process is
    out: dict = {"harness_error": None, "startup_s": {}, "ranks": [], "requests": None}
    t0 = time.monotonic()
    out["_t0"] = t0
    procs = []
    workdir = tempfile.mkdtemp(prefix="sglang-ranks-")
    code = 0
    try:
        if args.tp < 1 or args.concurrency < 1:
            raise HarnessError("--tp and --concurrency must be at least 1")
        requests = load_requests(args.requests)
        os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")  # get_local_ip_auto reads it first (network.py:417)
        if args.recv_timeout_s is not None:
            os.environ["SGLANG_ENCODER_RECV_TIMEOUT"] = str(args.recv_timeout_s)
        configure_logging(args.log_level, "driver")

        import multiprocessing as mp

        import sglang
        import sglang.srt.disaggregation.encoder.receiver  # noqa: F401 - paid once, before the fork
        import sglang.srt.managers.tokenizer_manager  # noqa: F401
        import sglang_env  # tests/ is sys.path[0] when run as a script
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import ServerArgs

        out["startup_s"]["import"] = time.monotonic() - t0
        model_dir = sglang_env.write_tiny_qwen2_vl_config(os.path.join(workdir, "model"))
        server_args = ServerArgs(model_path=model_dir, language_only=True, encoder_urls=[args.encoder_url],
                                 encoder_transfer_backend=args.backend, device="cpu", tp_size=args.tp,
                                 skip_tokenizer_init=True)
        publish(server_args, role="tokenizer")
        out["harness"] = {"sglang": sglang.__version__, "backend": args.backend, "tp": args.tp,
                          "encoder_url": args.encoder_url, "concurrency": args.concurrency, "tick_s": args.tick_s,
                          "host_ip": os.environ["SGLANG_HOST_IP"], "requests": len(requests)}
        endpoints = {"cmd": f"ipc://{workdir}/cmd", "results": f"ipc://{workdir}/results"}
        gloo_port = _free_port()
        fork = mp.get_context("fork")
        for rank in range(args.tp):
            proc = fork.Process(target=rank_main, name=f"sglang-rank{rank}", daemon=True,
                                args=(rank, args, server_args, gloo_port, endpoints["cmd"], endpoints["results"]))
            proc.start()
            procs.append(proc)
        asyncio.run(drive(args, server_args, procs, endpoints, requests, out))
    except HarnessError as exc:
        out["harness_error"] = str(exc)
        print(f"sglang_ranks: harness error: {exc}", file=sys.stderr)
        code = 2
    except BaseException as exc:  # noqa: BLE001
        out["harness_error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        code = 2
    finally:
        for proc in procs:
            proc.join(timeout=10 if code == 0 else 1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)
        out["wall_s"] = time.monotonic() - t0
        out.pop("_t0", None)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return code


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # skip the interpreter's teardown of torch and SGLang (about 2 s); results are written
