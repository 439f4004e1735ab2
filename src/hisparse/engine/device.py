"""From `LLM`'s arguments to the engine's devices, pool sizes and decode path.

The device must exist; the KV budget must fit its free memory; the default host pool holds
``max_num_seqs`` requests of ``max_model_len`` (capped by the host memory there is); decode
runs as CUDA graphs on CUDA unless a part of the step cannot be captured.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from hisparse import envs
from hisparse.config import HiSparseConfigError, cdiv
from hisparse.defaults import DEFAULT_FREE_MEMORY_FRACTION
from hisparse.kv.host_pool import MAX_AVAILABLE_FRACTION, available_host_bytes
from hisparse.kv.specs import CacheKind
from hisparse.validation import _fail

#: The default host pool takes at most this fraction of the host memory available.
DEFAULT_HOST_POOL_FRACTION = 0.5


def default_host_pool_bytes(
    specs: list[Any],
    config: Any,
    max_model_len: int,
    max_num_seqs: int,
    available: int | None = None,
    host_shards: int = 1,
    indexer_copy: bool = False,
) -> int:
    """What ``max_num_seqs`` requests of ``max_model_len`` tokens hold on the host (their
    pages, a copy-on-write tail each, the null block), capped at half the host memory
    ``available`` (default: now), and at least one such request. ``host_shards``: host rows
    hold that many ranks' slices of the specs' rows (`plan_kv_layout`); ``indexer_copy``:
    a host block also holds its page's indexer keys (prefix caching)."""
    bs = config.block_size
    block = sum(s.row_bytes for s in specs if s.kind is CacheKind.SPARSE) * bs * host_shards
    if indexer_copy:
        block += sum(s.page_bytes for s in specs if s.kind is CacheKind.INDEXER)
    per_request = cdiv(max_model_len, bs) + 1
    want = (max_num_seqs * per_request + 1) * block
    available = available_host_bytes() if available is None else available
    floor = config.min_host_blocks(max_model_len) * block
    if floor > MAX_AVAILABLE_FRACTION * available:
        raise HiSparseConfigError(
            f"one request of max_model_len={max_model_len} needs a host pool of "
            f"{floor / 2**30:.2f} GiB, more than the {available / 2**30:.2f} GiB of host "
            "memory available; lower max_model_len.",
            field="LLM.max_model_len",
            value=max_model_len,
        )
    return max(min(want, int(DEFAULT_HOST_POOL_FRACTION * available)), floor)


def check_device_memory(device: torch.device, gib: float) -> None:
    """The KV budget must fit the device's free memory (host memory on a CPU run)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = available_host_bytes()
    if gib * 2**30 > MAX_AVAILABLE_FRACTION * free:
        _fail(
            "LLM.gpu_memory_gib", gib,
            f"at most {MAX_AVAILABLE_FRACTION * free / 2**30:.2f} GiB "
            f"({MAX_AVAILABLE_FRACTION:.0%} of the {free / 2**30:.2f} GiB free on {device})",
        )  # fmt: skip


def capture_blockers(device: torch.device, indexer: str) -> list[str]:
    """Why a decode step on ``device`` could not be captured as a CUDA graph: the parts that
    would read device values on the host (the PyTorch references, the quest indexer)."""
    from hisparse.runtime.ops import has_capability, ops_for

    out = []
    if not has_capability(ops_for(device), "CUDA_GRAPH_CAPTURABLE"):
        out.append("the data-plane ops are not the Triton kernels (HISPARSE_OPS, or no Triton)")
    for var in ("HISPARSE_INDEXER", "HISPARSE_ATTENTION"):
        if envs.value(var) == "reference":
            out.append(f"{var}=reference")
    if indexer == "quest":
        out.append("indexer='quest' reads page bounds on the host")
    return out


def decode_path(
    cuda_graphs: bool | None,
    device: torch.device,
    indexer: str = "fp8",
    tensor_parallel_size: int = 1,
    capture_by_default: bool = True,
) -> str:
    """`ModelRunner` decode path for the ``cuda_graphs`` argument on ``device``: CUDA graphs by
    default on CUDA, unless a part of the step cannot be captured (then the same fixed-shape
    step runs eagerly, with a warning; asking for graphs explicitly is then an error). With
    tensor parallelism graphs are opt-in (``cuda_graphs=True``): capturing the NCCL
    all-reduces has not been run yet (docs/design.md §18); the default runs the same
    fixed-shape step eagerly."""
    if cuda_graphs is False or (cuda_graphs is None and device.type != "cuda"):
        return "eager"
    if device.type != "cuda":
        return "padded"  # cuda_graphs=True on the CPU: the graphs' step, run eagerly
    if cuda_graphs is None and (tensor_parallel_size > 1 or not capture_by_default):
        return "padded"  # capture_by_default False: DeepSeek-V4, whose capture has not run
    blockers = capture_blockers(device, indexer)
    if not blockers:
        return "graphs"
    why = "; ".join(blockers)
    if cuda_graphs is True:
        raise ValueError(
            f"cuda_graphs=True: the decode step cannot be captured ({why}); pass "
            "cuda_graphs=False, or leave it unset to run the same step without graphs."
        )
    warnings.warn(f"decode runs without CUDA graphs: {why}", stacklevel=3)
    return "padded"


def checked_device(device: Any) -> torch.device:
    """``device`` (default: CUDA when there is one, else the CPU), or a clear error."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, str | torch.device):
        _fail("LLM.device", device, "'cpu', 'cuda[:N]', a torch.device or None", type_error=True)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise HiSparseConfigError(
            f"LLM.device={device!r} is not a device: use 'cpu' or 'cuda[:N]'.",
            field="LLM.device",
            value=device,
            requirement="'cpu' or 'cuda[:N]'",
        ) from e
    if dev.type not in ("cpu", "cuda"):
        _fail("LLM.device", device, "a 'cpu' or 'cuda[:N]' device (hisparse runs on those)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            _fail("LLM.device", device, "'cpu': this PyTorch sees no CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            _fail("LLM.device", device, f"one of the {torch.cuda.device_count()} CUDA devices")
    return dev


def default_kv_gib(device: torch.device, utilization: float | None = None) -> float:
    """The KV budget when ``gpu_memory_gib`` is not given. With ``utilization`` (vLLM's
    ``gpu_memory_utilization``): that fraction of the GPU's whole memory less what is already
    in use (this engine's weights, other processes), refused when nothing is left; on a CPU
    run that fraction of the host memory available. Without: `DEFAULT_FREE_MEMORY_FRACTION`
    of the GPU memory free now (1 GiB on the CPU)."""
    if utilization is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return DEFAULT_FREE_MEMORY_FRACTION * free / 2**30
        return 1.0
    if device.type != "cuda":
        return utilization * available_host_bytes() / 2**30
    free, total = torch.cuda.mem_get_info(device)
    budget = utilization * total - (total - free)
    if budget <= 0:
        used = (total - free) / total
        _fail(
            "LLM.gpu_memory_utilization", utilization,
            f"above the {used:.2f} of {device}'s {total / 2**30:.1f} GiB already in use "
            "(weights, other processes), so that some is left for the KV cache",
            example=round(min(used + 0.1, 0.95), 2),
        )  # fmt: skip
    return budget / 2**30


def host_sharing(tp: Any, gguf: bool) -> dict[str, Any]:
    """`KVCacheManager`'s host-pool arguments: one pool per node under tensor parallelism
    (docs/design.md §18), its rows written by local rank 0 (MLA rows are the same on every
    rank) or in per-rank slices (GQA rows are sharded by KV head)."""
    if tp is None:
        return dict(host_shards=1, host_shard=0, host_writer=True)
    from hisparse.parallel.shm import shared_host_pool

    def pool(size: int, pin: bool) -> Any:
        return shared_host_pool(size, pin, tp)

    if gguf:
        return dict(host_pool=pool, host_shards=tp.local_world_size,
                    host_shard=tp.local_rank, host_writer=True)  # fmt: skip
    return dict(host_pool=pool, host_shards=1, host_shard=0, host_writer=tp.local_rank == 0)
