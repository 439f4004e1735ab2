"""Tensor parallelism inside the engine: what a rank other than 0 runs (the driver's commands,
step by step) and the state each rank reports (`LLM._tensor_parallel_state`)."""

from __future__ import annotations

import os
import zlib
from typing import TYPE_CHECKING, Any

import torch

from hisparse.engine.request import Request

if TYPE_CHECKING:
    from hisparse.engine.llm import LLM


def serve_tensor_parallel(llm: LLM) -> str:
    """A rank other than 0: follow the driver's commands until it closes the engine
    (``"close"``) or its process ends (``"exit"``, torchrun); returns which."""
    tp = llm._tp
    assert tp is not None and not tp.is_driver
    sched = llm.scheduler
    while True:
        op, *args = tp.recv()
        if op == "step":
            for part in sched.schedule():
                llm._run_part(part)
            sched.failed.clear()
            llm.runner.flush_metrics()
        elif op == "add":
            for rid, ids, params, index in args[0]:
                sched.add(Request(req_id=rid, prompt_token_ids=ids, params=params,
                                  index=index))  # fmt: skip
        elif op == "abort":
            ids = set(args[0])
            for req in [r for r in [*sched.running, *sched.waiting] if r.req_id in ids]:
                sched.abort(req)
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
        hot_state=[(crc(g.hot_index), crc(g.lru)) for g in leaders if kv.offload],
        gpu_pool=crc(kv.gpu_raw) if kv.gpu_raw.numel() <= 2**28 else None,  # test sizes
        # step hooks that record a digest (`hisparse.testing.tp_hooks.SelectionDigest`)
        selections=getattr(runner.hooks, "digest", None),
    )  # fmt: skip
