"""A scheduler TP rank of the SGLang receiver harness: the process ``tests/sglang_ranks.py`` forks per rank.

Each rank plays SGLang's scheduler: a real TP group (SGLang's
``init_distributed_environment`` + ``initialize_model_parallel``, gloo, on the CPU),
and each tick rank 0 broadcasts what the driver sent with SGLang's ``broadcast_pyobj``
over the TP CPU group, as ``SchedulerRequestReceiver._broadcast_reqs_across_ranks``
does. Under ``zmq_to_scheduler`` every rank runs
``MMReceiverHTTP.process_waiting_requests`` on what it got (``WaitingZmqRequest``:
``/scheduler_receive_url`` registration, its own PULL socket, the MIN all-reduce of
statuses on the TP CPU group every tick, ``_sync_fail_info_across_tp``), exactly as
``SchedulerRequestReceiver._apply_mm_receiver``; under ``zmq_to_tokenizer`` the
scheduler has no receiver (``scheduler.py:1652``) and a rank holds the embedding once
the broadcast request reaches it. The scheduler object is a stand-in with only what
``MMReceiverBase.create_req`` reads (it builds the ``Req`` of an abort). A rank
reports ``ready``, one ``result`` per request, its ``final`` stats or a ``crash`` to
the driver over a PUSH socket.
"""

from __future__ import annotations

import os
import time
import traceback

from sglang_recording import RecordingProcessor, configure_logging, describe, keep_receiver_log


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

    configure_logging(args.log_level, f"rank{rank}")
    log_records = keep_receiver_log()
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
