"""`LLM`'s constructor arguments, checked by type and range before anything loads
(`hisparse.validation`: each error names the ``LLM.`` field and a value that works)."""

from __future__ import annotations

from typing import Any

import torch

from hisparse.config import HiSparseConfig, check_gib
from hisparse.engine.hooks import StepHooks
from hisparse.engine.scheduler import SCHEDULE_POLICIES
from hisparse.models.registry import INDEXERS, KV_FORMATS
from hisparse.validation import (
    _fail,
    check_bool,
    check_choice,
    check_dtype,
    check_float,
    check_int,
)

PLACEMENTS = ("hisparse", "gpu")
#: Most requests running at once (the engine keeps per-slot state for every one).
MAX_NUM_SEQS = 4096


def check_llm_args(a: dict[str, Any]) -> torch.dtype | None:
    """Check ``LLM(**a)``'s arguments; returns the model dtype asked for (``None``: auto)."""
    f = "LLM."
    check_choice(f + "schedule", a["schedule"], SCHEDULE_POLICIES)
    check_choice(f + "kv_placement", a["kv_placement"], PLACEMENTS)
    if a["hisparse"] is not None and not isinstance(a["hisparse"], HiSparseConfig):
        _fail(f + "hisparse", a["hisparse"], "a HiSparseConfig or None", type_error=True)
    check_int(f + "max_num_seqs", a["max_num_seqs"], minimum=1, maximum=MAX_NUM_SEQS, example=8)
    check_int(f + "max_model_len", a["max_model_len"], minimum=2, example=4096, optional=True)
    gib, utilization = a["gpu_memory_gib"], a["gpu_memory_utilization"]
    if gib is not None:
        check_gib(f + "gpu_memory_gib", gib)
    check_float(f + "gpu_memory_utilization", utilization, minimum=0, open_min=True, maximum=1,
                example=0.9, optional=True)  # fmt: skip
    if gib is not None and utilization is not None:
        _fail(f + "gpu_memory_utilization", utilization, "None when gpu_memory_gib is given "
              "(one KV budget: GiB, or a fraction of the GPU)")  # fmt: skip
    check_choice(f + "kv_format", a["kv_format"], KV_FORMATS)
    check_choice(f + "indexer", a["indexer"], INDEXERS)
    check_int(f + "max_num_batched_tokens", a["max_num_batched_tokens"], minimum=1, example=2048)
    if a["step_hooks"] is not None and not isinstance(a["step_hooks"], StepHooks):
        _fail(f + "step_hooks", a["step_hooks"], "a StepHooks (or None)", type_error=True)
    check_bool(f + "cuda_graphs", a["cuda_graphs"], optional=True)
    check_bool(f + "async_scheduling", a["async_scheduling"])
    check_int(f + "tensor_parallel_size", a["tensor_parallel_size"], minimum=1, maximum=4096,
              example=2)  # fmt: skip
    check_int(f + "data_parallel_size", a["data_parallel_size"], minimum=1, maximum=4096,
              example=2)  # fmt: skip
    check_bool(f + "enable_expert_parallel", a["enable_expert_parallel"])
    check_bool(f + "enable_prefix_caching", a["enable_prefix_caching"])
    return check_dtype(f + "dtype", a["dtype"])
