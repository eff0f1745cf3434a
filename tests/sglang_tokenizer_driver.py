"""The driver of the SGLang receiver harness: it plays SGLang's tokenizer manager against the forked ranks.

Its receiver is built as ``tokenizer_manager.py:828`` builds it
(``create_mm_receiver(server_args, hf_config=..., encode_urls=<shared list>)``, no
scheduler). ``zmq_to_scheduler``: per request it calls
``MMReceiverHTTP.send_encode_request`` (``receiver.py:2190``; a thread runs
``MMReceiverHTTP.encode`` with ``embedding_port=None``, as
``tokenizer_manager.py:3934`` does), sends the ``TokenizedGenerateReqInput`` (with
the ``num_items_assigned`` and ``encoder_urls`` SGLang set on the request) to TP rank
0, then sets the dispatch-ready event; a dispatch error reaches the ranks as SGLang's
``EncoderDispatchErrorReq`` (``tokenizer_manager.py:3876-3883``).
``zmq_to_tokenizer``: per request it awaits ``MMReceiverBase.recv_mm_data``
(``receiver.py:2054``, as ``tokenizer_manager.py:1189`` does): SGLang binds a PULL
socket on the host IP, calls ``encode`` with that ``embedding_port`` and receives the
one copy; ``None`` goes through SGLang's
``_reject_missing_dispatched_encoder_embedding`` (its 503 is the abort reason),
otherwise the request with its ``mm_inputs`` goes to TP rank 0. ``drive`` runs the
requests, collects every rank's result per request, and raises ``HarnessError`` when
the harness itself breaks.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
import threading
import time

from sglang_recording import PROMPT_IDS, RecordingProcessor, describe, keep_receiver_log


class HarnessError(RuntimeError):
    """The harness itself broke (not a request's abort)."""


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
        self.log_records = keep_receiver_log()

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
            rid=obj.rid, input_text=obj.text, input_ids=array("q", PROMPT_IDS), input_embeds=None,
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
                request_obj=obj, mm_processor=processor, prompt=list(PROMPT_IDS), need_wait_for_mm_inputs=True)
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


async def drive(args, server_args, procs, endpoints, requests, out: dict) -> None:
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
