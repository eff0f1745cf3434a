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

Processes (forked after the SGLang imports, so they are paid once):

* the driver plays SGLang's tokenizer manager. Its receiver is built as
  ``tokenizer_manager.py:828`` builds it (``create_mm_receiver(server_args,
  hf_config=..., encode_urls=<shared list>)``, no scheduler).
  ``zmq_to_scheduler``: per request it calls ``MMReceiverHTTP.send_encode_request``
  (``receiver.py:2190``; a thread runs ``MMReceiverHTTP.encode`` with
  ``embedding_port=None``, as ``tokenizer_manager.py:3934`` does), sends the
  ``TokenizedGenerateReqInput`` (with the ``num_items_assigned`` and
  ``encoder_urls`` SGLang set on the request) to TP rank 0, then sets the
  dispatch-ready event; a dispatch error reaches the ranks as SGLang's
  ``EncoderDispatchErrorReq`` (``tokenizer_manager.py:3876-3883``).
  ``zmq_to_tokenizer``: per request it awaits ``MMReceiverBase.recv_mm_data``
  (``receiver.py:2054``, as ``tokenizer_manager.py:1189`` does): SGLang binds a
  PULL socket on the host IP, calls ``encode`` with that ``embedding_port`` and
  receives the one copy; ``None`` goes through SGLang's
  ``_reject_missing_dispatched_encoder_embedding`` (its 503 is the abort reason),
  otherwise the request with its ``mm_inputs`` goes to TP rank 0.
* ``--tp`` rank processes play the scheduler: a real TP group (SGLang's
  ``init_distributed_environment`` + ``initialize_model_parallel``, gloo, on the
  CPU), and each tick rank 0 broadcasts what the driver sent with SGLang's
  ``broadcast_pyobj`` over the TP CPU group, as
  ``SchedulerRequestReceiver._broadcast_reqs_across_ranks`` does. Under
  ``zmq_to_scheduler`` every rank runs ``MMReceiverHTTP.process_waiting_requests``
  on what it got (``WaitingZmqRequest``: ``/scheduler_receive_url`` registration,
  its own PULL socket, the MIN all-reduce of statuses on the TP CPU group every
  tick, ``_sync_fail_info_across_tp``), exactly as
  ``SchedulerRequestReceiver._apply_mm_receiver``; under ``zmq_to_tokenizer`` the
  scheduler has no receiver (``scheduler.py:1652``) and a rank holds the
  embedding once the broadcast request reaches it.

Stand-ins: ``mm_processor.get_validated_mm_data`` records what SGLang passes it
(the embedding per modality and the kwargs such as ``img_grid_thw``) and returns
a small picklable object with ``input_ids``; the scheduler object has only what
``MMReceiverBase.create_req`` reads (it builds the ``Req`` of an abort).

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
import hashlib
import json
import os
import pickle
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback

BACKENDS = ("zmq_to_scheduler", "zmq_to_tokenizer")
_PROMPT_IDS = [151644, 872, 198, 151652, 151655, 151653, 151645]  # any ids: the stand-in processor ignores them


class HarnessError(RuntimeError):
    """The harness itself broke (not a request's abort)."""


# ---------------------------------------------------------------- recorded mm inputs (picklable)

class RecordedMMInputs:
    """What the stand-in ``get_validated_mm_data`` returns: SGLang sets it as ``recv_req.mm_inputs``."""

    def __init__(self, input_ids, embeddings, meta, held_at):
        self.input_ids = list(input_ids)
        self.embeddings = embeddings  # modality name -> tensor, as SGLang handed it over
        self.meta = meta  # the non-None kwargs (img_grid_thw, ...)
        self.held_at = held_at  # time.monotonic() when SGLang handed it over


class RecordingProcessor:
    """Stands in for the model's multimodal processor; records each ``get_validated_mm_data`` call."""

    prefer_tokenized_input = True

    def __init__(self):
        self.calls = 0

    def get_validated_mm_data(self, prompt, recv_embedding, **kwargs):
        held_at = time.monotonic()
        self.calls += 1
        embeddings = {getattr(m, "name", str(m)): t for m, t in dict(recv_embedding).items()}
        meta = {k: v for k, v in kwargs.items() if v is not None}
        input_ids = prompt if isinstance(prompt, list) else list(_PROMPT_IDS)
        return RecordedMMInputs(input_ids, embeddings, meta, held_at)


def describe(mm_inputs) -> dict:
    """sha256/dtype/shape per modality and the grid of recorded mm inputs."""
    import torch

    out = {"embeddings": {}, "img_grid_thw": None, "meta_keys": []}
    if mm_inputs is None:
        return out
    for name, tensor in mm_inputs.embeddings.items():
        t = tensor.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()  # the bytes as they lie in memory, no copy
        out["embeddings"][name] = {
            "sha256": hashlib.sha256(raw).hexdigest(), "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape), "nbytes": raw.nbytes,
        }
    grid = mm_inputs.meta.get("img_grid_thw")
    if grid is not None:
        out["img_grid_thw"] = grid.tolist() if hasattr(grid, "tolist") else list(grid)
    out["meta_keys"] = sorted(mm_inputs.meta)
    return out


# ---------------------------------------------------------------- arguments and input

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


def _keep_receiver_log() -> list:
    """Keep (monotonic time, level, message) of SGLang's receiver warnings and errors in this process."""
    import logging

    records: list[tuple[float, str, str]] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append((time.monotonic(), record.levelname, record.getMessage()))

    logging.getLogger("sglang.srt.disaggregation.encoder.receiver").addHandler(_Keep(level=logging.WARNING))
    return records


def _configure_logging(level: str, who: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format=f"%(asctime)s [{who}] %(levelname)s %(name)s: %(message)s",
                        force=True)


# ---------------------------------------------------------------- a TP rank (scheduler side)

def rank_main(rank: int, args, server_args, gloo_port: int, cmd_endpoint: str, results_endpoint: str) -> None:
    """One scheduler TP rank: SGLang's TP group, its receiver, its per-tick broadcast and status all-reduce."""
    import ctypes

    import zmq

    try:  # die with the driver (Linux): a rank left behind would block in gloo forever
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except OSError:
        pass
    zmq_ctx = zmq.Context()
    results = zmq_ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.SNDTIMEO, 30_000)
    results.connect(results_endpoint)
    try:
        _rank_loop(rank, args, server_args, gloo_port, cmd_endpoint, results)
    except BaseException as exc:  # noqa: BLE001 - report anything to the driver, then die
        results.send_pyobj({"type": "crash", "rank": rank, "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()})
        results.close(linger=2000)
        zmq_ctx.term()  # close() only queues: term() waits for the I/O thread to deliver, os._exit would not
        os._exit(3)
    results.close(linger=5000)
    zmq_ctx.term()
    os._exit(0)


def _rank_loop(rank, args, server_args, gloo_port, cmd_endpoint, results) -> None:
    import types

    import torch
    import zmq
    from sglang.srt.disaggregation.encoder.receiver import create_mm_receiver
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.managers.io_struct import EncoderDispatchErrorReq, TokenizedGenerateReqInput
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.utils.common import broadcast_pyobj

    _configure_logging(args.log_level, f"rank{rank}")
    log_records = _keep_receiver_log()
    setup_cpu0 = time.process_time()
    torch.set_num_threads(1)
    publish(server_args, role="scheduler")
    init_distributed_environment(world_size=args.tp, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{gloo_port}")
    get_parallel().override_permanently(tp_rank=rank, pp_rank=0)
    initialize_model_parallel()
    tp_group = get_parallel().tp_group

    receiver = None
    processor = RecordingProcessor()
    if args.backend == "zmq_to_scheduler":
        # Only what MMReceiverBase reads from its scheduler: create_req (the Req of an abort).
        scheduler = types.SimpleNamespace(
            model_config=types.SimpleNamespace(hf_eos_token_id=None, vocab_size=151936),
            disaggregation_mode=DisaggregationMode.NULL, metrics_reporter=types.SimpleNamespace(enable_metrics=False),
            metrics_collector=None, dllm_config=None, tokenizer=None)
        receiver = create_mm_receiver(server_args, hf_config=None, scheduler=scheduler)  # as scheduler.py:1657
        receiver.mm_processor = processor  # _init_mm_processor needs the model's processor files

    cmd = None
    poller = zmq.Poller()
    if rank == 0:
        cmd = zmq.Context().socket(zmq.PULL)
        cmd.connect(cmd_endpoint)
        poller.register(cmd, zmq.POLLIN)
        if receiver is not None:
            poller.register(receiver.scheduler_recv_socket, zmq.POLLIN)

    results.send_pyobj({"type": "ready", "rank": rank, "pid": os.getpid(),
                        "embedding_port": getattr(receiver, "scheduler_embedding_port", None),
                        "host": getattr(receiver, "hostname", None), "setup_cpu_s": time.process_time() - setup_cpu0})

    cpu0, wall0, hash_cpu, ticks = time.process_time(), time.monotonic(), 0.0, 0
    seen: dict[str, tuple[float, float]] = {}  # rid -> (process_time, monotonic) when the rank first saw it
    stop = False
    while not stop:
        incoming = []
        if rank == 0:
            # Wake on the driver or on this rank's embedding socket; tick at least every --tick-s while
            # requests wait (the other ranks follow through the broadcast below), every 50 ms when idle.
            waiting = receiver is not None and bool(receiver.waiting_list)
            poller.poll(timeout=max(1, int(1000 * (args.tick_s if waiting else 0.05))))
            while True:
                try:
                    incoming.append(cmd.recv_pyobj(flags=zmq.NOBLOCK))
                except zmq.Again:
                    break
        # The scheduler's recv_requests: rank 0's input reaches every TP rank by broadcast.
        if args.tp != 1:
            incoming = broadcast_pyobj(incoming, tp_group.rank, tp_group.cpu_group, src=tp_group.ranks[0])
        ticks += 1
        reqs = []
        for item in incoming:
            if isinstance(item, dict) and item.get("op") == "stop":
                stop = True
            elif isinstance(item, (TokenizedGenerateReqInput, EncoderDispatchErrorReq)):
                if isinstance(item, TokenizedGenerateReqInput):
                    seen[item.rid] = (time.process_time(), time.monotonic())
                reqs.append(item)
        if receiver is None:  # zmq_to_tokenizer: the request carries the embedding, nothing waits here
            admitted, aborts = [r for r in reqs if isinstance(r, TokenizedGenerateReqInput)], []
        elif reqs or receiver.waiting_list:
            admitted, aborts = receiver.process_waiting_requests(reqs)
        else:
            admitted, aborts = [], []
        now = time.monotonic()
        resolved = [(r.rid, "admitted", None, None, r.mm_inputs) for r in admitted
                    if isinstance(r, TokenizedGenerateReqInput)]
        for req, error_msg, error_code in aborts:
            resolved.append((req.rid, "aborted", error_msg, None if error_code is None else int(error_code), None))
        for rid, status, error_msg, error_code, mm_inputs in resolved:
            cpu_at, seen_at = seen.pop(rid, (time.process_time(), now))
            h0 = time.process_time()
            entry = {"type": "result", "rank": rank, "rid": rid, "status": status, "error_msg": error_msg,
                     "error_code": error_code, "resolved_at": now, "cpu_s": h0 - cpu_at,
                     "held_at": getattr(mm_inputs, "held_at", None),
                     "receiver_log": [f"{lvl} {msg}" for at, lvl, msg in list(log_records) if at >= seen_at]}
            if receiver is None and mm_inputs is not None:
                entry["held_at"] = now  # zmq_to_tokenizer: held once the broadcast request arrived
            entry.update(describe(mm_inputs))
            hash_cpu += time.process_time() - h0
            results.send_pyobj(entry)
    cpu_s, wall_s = time.process_time() - cpu0 - hash_cpu, time.monotonic() - wall0
    # Leave together: a rank that exits while a peer still reads its last broadcast can reset the connection.
    torch.distributed.barrier(group=tp_group.cpu_group)
    pending = [w.rid for w in (receiver.waiting_list if receiver is not None else [])]
    for rid in pending:  # only when the driver stopped early (--timeout-s)
        results.send_pyobj({"type": "result", "rank": rank, "rid": rid, "status": "pending", "error_msg": None,
                            "error_code": None, "resolved_at": None, "held_at": None})
    results.send_pyobj({"type": "final", "rank": rank, "cpu_s": cpu_s, "hash_cpu_s": hash_cpu, "wall_s": wall_s,
                        "ticks": ticks, "pending": pending, "get_validated_mm_data_calls": processor.calls})


# ---------------------------------------------------------------- the driver (tokenizer side)

class Driver:
    def __init__(self, args, server_args, procs, cmd, results, tokenizer_receiver):
        self.args, self.server_args, self.procs = args, server_args, procs
        self.cmd, self.results, self.receiver = cmd, results, tokenizer_receiver
        self.rank_info: dict[int, dict] = {}
        self.finals: dict[int, dict] = {}
        self.per_rid: dict[str, dict[int, dict]] = {}
        self.done: dict[str, asyncio.Future] = {}
        self.crash: str | None = None
        self.loop = asyncio.get_running_loop()
        # SGLang's tokenizer-side receiver logs why it gave up (it returns None); keep its warnings and errors.
        self.log_records = _keep_receiver_log()

    async def pump(self) -> None:
        """Route the ranks' messages: ready, one result per (request, rank), final stats, crashes."""
        while True:
            msg = await self.results.recv_pyobj()
            kind = msg["type"]
            if kind == "ready":
                self.rank_info[msg["rank"]] = msg
            elif kind == "final":
                self.finals[msg["rank"]] = msg
            elif kind == "crash":
                self.crash = f"rank {msg['rank']} crashed: {msg['error']}\n{msg['traceback']}"
                for fut in self.done.values():
                    if not fut.done():
                        fut.set_exception(HarnessError(self.crash))
            elif kind == "result":
                got = self.per_rid.setdefault(msg["rid"], {})
                got[msg["rank"]] = msg
                fut = self.done.get(msg["rid"])
                if fut is not None and len(got) == self.args.tp and not fut.done():
                    fut.set_result(got)

    async def watch_procs(self) -> None:
        """Raise when a rank process exits before its final stats arrived (a crash report wins)."""
        while True:
            await asyncio.sleep(0.2)
            for rank, proc in enumerate(self.procs):
                if proc.exitcode is None or (proc.exitcode == 0 and rank in self.finals):
                    continue
                await asyncio.sleep(0.5)  # let a crash report or the final stats arrive first
                if proc.exitcode == 0 and rank in self.finals:
                    continue
                raise HarnessError(self.crash or f"rank {rank} exited with status {proc.exitcode}")

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + self.args.ready_timeout_s
        while len(self.rank_info) < self.args.tp:
            if self.crash:
                raise HarnessError(self.crash)
            if time.monotonic() > deadline:
                raise HarnessError(f"ranks not ready after {self.args.ready_timeout_s} s: {sorted(self.rank_info)}")
            await asyncio.sleep(0.01)

    def send_quietly(self, obj) -> None:
        import zmq

        try:
            self.send(obj, block=False)
        except zmq.Again:
            print(f"sglang_ranks: could not pass {type(obj).__name__} to rank 0", file=sys.stderr)

    async def wait_finals(self) -> None:
        while len(self.finals) < self.args.tp:
            if self.crash:
                raise HarnessError(self.crash)
            await asyncio.sleep(0.005)

    def send(self, obj, block: bool = True) -> None:
        import zmq

        self.cmd.send(pickle.dumps(obj), flags=0 if block else zmq.NOBLOCK)

    def _generate_obj(self, req):
        from sglang.srt.managers.io_struct import GenerateReqInput

        return GenerateReqInput(rid=req["rid"], text="<image>", image_data=list(req["images"]))

    def _tokenized(self, obj, mm_inputs=None):
        from array import array

        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        return TokenizedGenerateReqInput(
            rid=obj.rid, input_text=obj.text, input_ids=array("q", _PROMPT_IDS), input_embeds=None,
            mm_inputs=mm_inputs, token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=1),
            return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
            need_wait_for_mm_inputs=obj.need_wait_for_mm_inputs, num_items_assigned=obj.num_items_assigned,
            encoder_urls=obj.encoder_urls)

    async def run_one(self, req) -> dict:
        rid = req["rid"]
        fut = self.done[rid] = self.loop.create_future()
        if self.crash:
            raise HarnessError(self.crash)
        obj = self._generate_obj(req)
        # The tokenizer's receiver reads the shared URL list (the bootstrap server edits it in place):
        # the URL `parts` times makes SGLang's own _assign_items_by_modality split the images in `parts`.
        self.receiver.encode_urls[:] = [req.get("encoder_url", self.args.encoder_url)] * req["parts"]
        record = {"rid": rid, "images": len(req["images"]), "parts_requested": req["parts"],
                  "dispatch_error": None, "tokenizer": None}
        cpu0 = time.process_time()
        t_dispatch = time.monotonic()
        if self.args.backend == "zmq_to_scheduler":
            def on_dispatch_error(error):  # called from SGLang's encode thread, as _schedule_encoder_dispatch_error
                record["dispatch_error"] = {"error_msg": error.error_msg, "error_code": error.error_code,
                                            "at_s": time.monotonic() - t_dispatch}
                self.loop.call_soon_threadsafe(self.send_quietly, error)

            obj.need_wait_for_mm_inputs = True  # _handle_epd_disaggregation_encode_request
            before = set(threading.enumerate())
            ready = self.receiver.send_encode_request(obj, on_dispatch_error=on_dispatch_error)
            encode_threads = [t for t in set(threading.enumerate()) - before if "_run_encode_in_thread" in t.name]
            self.send(self._tokenized(obj))
            if ready is not None:
                ready.set()  # tokenizer_manager.py:1792-1794: the request reached the scheduler
        else:
            obj.need_wait_for_mm_inputs = True
            processor = RecordingProcessor()
            mm_inputs = await self.receiver.recv_mm_data(
                request_obj=obj, mm_processor=processor, prompt=list(_PROMPT_IDS), need_wait_for_mm_inputs=True)
            tok = {"status": "admitted", "error_msg": None, "error_code": None,
                   "held_s": None if mm_inputs is None else mm_inputs.held_at - t_dispatch}
            tok.update(describe(mm_inputs))
            record["tokenizer"] = tok
            try:
                from sglang.srt.managers.tokenizer_manager import _reject_missing_dispatched_encoder_embedding

                _reject_missing_dispatched_encoder_embedding(obj, mm_inputs)
            except Exception as exc:  # fastapi.HTTPException: what the client would get
                tok.update(status="aborted", error_code=getattr(exc, "status_code", None),
                           error_msg=getattr(exc, "detail", None) or str(exc))
            if mm_inputs is None:
                fut.set_result({r: {"rank": r, "status": "aborted", "error_msg": tok["error_msg"],
                                    "error_code": tok["error_code"], "reached_rank": False} for r in
                                range(self.args.tp)})
            else:
                self.send(self._tokenized(obj, mm_inputs))
        per_rank = await fut
        if self.args.backend == "zmq_to_scheduler":
            # SGLang's dispatch thread ends when every /encode answered (after the encoder's pushes); wait for
            # it so its EncoderDispatchErrorReq, if any, reaches the ranks before the next request or the stop.
            while any(t.is_alive() for t in encode_threads):
                await asyncio.sleep(0.001)
            record["encode_returned_s"] = time.monotonic() - t_dispatch if encode_threads else None
            await asyncio.sleep(0)  # run a pending send_quietly
        record["driver_cpu_s"] = time.process_time() - cpu0
        record["receiver_log"] = [f"{lvl} {msg}" for at, lvl, msg in list(self.log_records) if at >= t_dispatch]
        record["num_items_assigned"] = ({getattr(m, "name", str(m)): list(v) for m, v in obj.num_items_assigned.items()}
                                        if obj.num_items_assigned else None)
        record["encoder_urls"] = obj.encoder_urls
        record["ranks"] = [self._rank_entry(per_rank[r], t_dispatch) for r in range(self.args.tp)]
        statuses = {e["status"] for e in record["ranks"]}
        digests = {json.dumps(e.get("embeddings"), sort_keys=True) for e in record["ranks"]}
        record["all_admitted"] = statuses == {"admitted"}
        record["ranks_agree"] = len(statuses) == 1 and (statuses != {"admitted"} or len(digests) == 1)
        return record

    @staticmethod
    def _rank_entry(msg: dict, t_dispatch: float) -> dict:
        entry = {k: v for k, v in msg.items() if k not in ("type", "rid", "held_at", "resolved_at")}
        entry["held_s"] = None if msg.get("held_at") is None else msg["held_at"] - t_dispatch
        entry["resolved_s"] = None if msg.get("resolved_at") is None else msg["resolved_at"] - t_dispatch
        return entry

    async def run_all(self, requests: list[dict]) -> list[dict]:
        sem = asyncio.Semaphore(self.args.concurrency)

        async def one(req):
            async with sem:
                return await self.run_one(req)

        return list(await asyncio.gather(*(one(r) for r in requests)))


async def _drive(args, server_args, procs, endpoints, requests, out: dict) -> None:
    import zmq
    import zmq.asyncio
    from sglang.srt.disaggregation.encoder.receiver import create_mm_receiver

    ctx = zmq.asyncio.Context()
    results = ctx.socket(zmq.PULL)
    results.bind(endpoints["results"])
    cmd = zmq.Context().socket(zmq.PUSH)
    cmd.setsockopt(zmq.LINGER, 0)
    cmd.setsockopt(zmq.SNDTIMEO, 30_000)  # never hang on a rank 0 that is gone
    cmd.bind(endpoints["cmd"])
    # tokenizer_manager.py:828: the tokenizer's receiver, no scheduler, a shared URL list.
    tokenizer_receiver = create_mm_receiver(server_args, hf_config=None, encode_urls=[args.encoder_url])
    driver = Driver(args, server_args, procs, cmd, results, tokenizer_receiver)
    pump = asyncio.create_task(driver.pump())
    watch = asyncio.create_task(driver.watch_procs())
    try:
        ready_task = asyncio.create_task(driver.wait_ready())
        await _first(ready_task, watch)
        out["ranks"] = [{k: v for k, v in driver.rank_info[r].items() if k != "type"} for r in range(args.tp)]
        out["startup_s"]["ranks_ready"] = time.monotonic() - out["_t0"]
        t_run = time.monotonic()
        run_task = asyncio.create_task(driver.run_all(requests))
        timed_out = False
        try:
            out["requests"] = await asyncio.wait_for(_first(run_task, watch), timeout=args.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        out["run_s"] = time.monotonic() - t_run
        driver.send_quietly({"op": "stop"})
        try:
            await asyncio.wait_for(_first(asyncio.create_task(driver.wait_finals()), watch), timeout=30)
        except asyncio.TimeoutError:
            if not timed_out:
                raise HarnessError(f"no final stats from ranks {set(range(args.tp)) - set(driver.finals)}") from None
        if timed_out:
            out["requests"] = [  # what arrived; a rank with nothing to say about a request is missing
                {"rid": rid, "incomplete": True, "ranks": [Driver._rank_entry(got[r], 0.0) for r in sorted(got)]}
                for rid, got in driver.per_rid.items()]
            raise HarnessError(f"--timeout-s {args.timeout_s} passed with requests unresolved "
                               "(results hold what had arrived; times in them are not relative to a dispatch)")
    finally:
        try:
            driver.send({"op": "stop"}, block=False)  # rank 0 may be gone: never wait for it here
        except Exception:  # noqa: BLE001
            pass
        for rank, final in driver.finals.items():
            info = out["ranks"][rank] if rank < len(out.get("ranks") or []) else {}
            info.update({k: v for k, v in final.items() if k not in ("type",)})
        pump.cancel()
        watch.cancel()


async def _first(task: asyncio.Task, watch: asyncio.Task):
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    watch.result()  # raises the harness error
    raise HarnessError("a rank process exited")


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
        _configure_logging(args.log_level, "driver")

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
        asyncio.run(_drive(args, server_args, procs, endpoints, requests, out))
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
