"""Tensor parallelism inside the engine: the entry points of the ranks other than 0 (a spawned
worker, a torchrun process), what they run (the driver's commands, step by step) and the state
each rank reports (`LLM._tensor_parallel_state`). `hisparse.parallel` never imports the
engine: `LLM` hands these entry points to `TPGroup.start`."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
import zlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hisparse.parallel import group as tp_group

if TYPE_CHECKING:
    from hisparse.engine.llm import LLM


def worker_main(spec: tp_group.WorkerSpec, report: Any) -> None:
    """Entry point of a spawned rank: build the same `LLM` as the driver on this rank's shard,
    then follow the driver's commands until it closes the engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    torch.set_num_threads(spec.num_threads)
    watch = threading.Thread(target=tp_group.exit_with_parent, args=(spec.parent_pid,))
    watch.daemon = True
    watch.start()
    status = 0
    try:
        report.send(("up",))
        from hisparse.engine.llm import LLM

        with tp_group.joining_as_worker(spec):
            llm = LLM(**spec.llm_kwargs)
        serve_tensor_parallel(llm)
    except BaseException:
        status = 1
        text = traceback.format_exc()
        print(f"hisparse tensor-parallel rank {spec.rank}:\n{text}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            report.send(("error", text))
    finally:
        report.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # no atexit work: the driver owns the shared pool and the process group


def serve_torchrun_ranks(device: torch.device) -> None:
    """A torchrun process of rank > 0: build every engine rank 0 announces (the same `LLM`
    arguments), follow its commands until rank 0 closes it, and exit when rank 0's process
    ends. Never returns."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    env = tp_group.torchrun_env()
    assert env is not None and env["rank"] > 0
    _, control = tp_group.torchrun_groups(tp_group.rank_device(device, env["local_rank"]))
    from hisparse.engine.llm import LLM

    status = 0
    try:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            if box[0][0] != "engine":
                break  # ("exit",): rank 0's process ended
            with tp_group.joining_as_worker():
                llm = LLM(**box[0][1])
            if serve_tensor_parallel(llm) == "exit":
                break
    except BaseException:
        status = 1
        traceback.print_exc()
    tp_group.drop_torchrun_groups()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def serve_tensor_parallel(llm: LLM) -> str:
    """A rank other than 0: follow the driver's commands until it closes the engine
    (``"close"``) or its process ends (``"exit"``, torchrun); returns which."""
    tp = llm._tp
    assert tp is not None and not tp.is_driver
    sched = llm.scheduler
    while True:
        op, *args = tp.recv()
        if op == "step":
            llm._core.step()
            sched.failed.clear()
            llm.runner.flush_metrics()
        elif op == "add":
            llm._core.add_from_driver(args[0])
        elif op == "abort":
            llm._core.abort_from_driver(args[0])
        elif op == "max_num_seqs":
            sched.max_num_seqs = args[0]
        elif op == "state":
            tp.gather(rank_state(llm))
        elif op in ("close", "exit"):
            break
        else:
            raise RuntimeError(f"unknown tensor-parallel command {op!r}")
    llm.close()
    return op


def tensor_parallel_state(llm: LLM) -> list[dict[str, Any]]:
    """Every rank's `rank_state`, in rank order (tests: one host pool per node, the same
    selections everywhere)."""
    tp = llm._tp
    if tp is None:
        return [rank_state(llm)]
    with llm._core.tp_section():
        tp.send(("state",))
        out = tp.gather(rank_state(llm))
    assert out is not None
    return out


def rank_state(llm: LLM) -> dict[str, Any]:
    """This rank's host pool (who created it, which file it maps) and digests of its hot
    state, its GPU pool and (with such hooks) its selections."""

    def crc(t: torch.Tensor) -> int:
        return zlib.crc32(t.detach().contiguous().cpu().view(torch.uint8).numpy())

    kv, runner, tp = llm.kv, llm.runner, llm._tp
    assert kv is not None and runner is not None
    pool = kv.host_pool
    leaders = [h.runtime.group for h in runner.leaders]
    return dict(
        rank=0 if tp is None else tp.rank,
        pid=os.getpid(),
        host_pool=None if pool is None else dict(
            size=pool.size, created=pool.created, inode=pool.inode,
            shared=pool.shared is not None,
        ),
        host_pool_bytes=kv.layout.host_pool_bytes,
        host_writer=kv.host_writer,
        hot_state=[(crc(g.hot_index), crc(g.lru)) for g in leaders if kv.hisparse],
        gpu_pool=crc(kv.gpu_raw) if kv.gpu_raw.numel() <= 2**28 else None,  # test sizes
        # step hooks that record a digest (`hisparse.testing.tp_hooks.SelectionDigest`)
        selections=getattr(runner.hooks, "digest", None),
    )  # fmt: skip
