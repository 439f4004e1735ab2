"""The CPU backend: data-plane ops, compiled kernels, and the state of its fast paths."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hisparse import envs
from hisparse.kv.row_formats import fp8_values
from hisparse.runtime.ops.cpu import ops
from hisparse.runtime.ops.cpu.compile import build
from hisparse.runtime.ops.cpu.numpy_views import NumpyViews
from hisparse.runtime.ops.cpu.step_arrays import StepArrays

if TYPE_CHECKING:
    from hisparse.runtime.batch import StepMetadata


class CpuBackend:
    """The ops namespace registered for ``cpu`` tensors, and what its batch-1 fast paths keep.

    The ops are `ops`' (numpy, the reference's results bit for bit). The compiled kernels
    (`jit`) serve the fast paths of the runtime (resolve, gathers, invalidation, mirror), the
    Llama model (rotary, row writes, selection, attention, norm) and the attention references'
    CPU forms. Everything those paths remember between calls lives on this object, so a test
    can switch a path off on the one instance (`hisparse.runtime.ops.cpu_backend`).
    """

    gather_compact = staticmethod(ops.gather_compact)
    gather_compact_group = staticmethod(ops.gather_compact_group)
    gather_plan = staticmethod(ops.gather_plan)
    invalidate_written_slots = staticmethod(ops.invalidate_written_slots)
    resident_rows = staticmethod(ops.resident_rows)
    scatter_rows = staticmethod(ops.scatter_rows)

    def __init__(self) -> None:
        #: Capabilities (`hisparse.runtime.ops.CAPABILITIES`), declared on the instance:
        #: numpy on the tensors' memory syncs with the host, so no graph capture; the runtime's
        #: compiled batch-1 decode path may stand in for these ops on CPU tensors (its results
        #: equal theirs bit for bit: tests/test_cpu_decode_step.py).
        self.CUDA_GRAPH_CAPTURABLE = False
        self.CPU_DECODE_FAST_PATH = True
        #: The compiled kernels on or off (``HISPARSE_CPU_JIT=0``: numpy/torch everywhere).
        self.jit_enabled = envs.value("HISPARSE_CPU_JIT")
        #: The Llama batch-1 decode path (`LlamaForCausalLM._decode_one_cpu`) on or off
        #: (``HISPARSE_CPU_FAST=0``: A/B checks).
        self.fast_decode = envs.value("HISPARSE_CPU_FAST")
        #: A batch with one live request takes the resolve's shorter form (tests turn it off
        #: to run the batched form on such batches).
        self.one_request_path = True
        #: numpy views of the pools' rows and index pages, remembered per tensor.
        self.views = NumpyViews()
        self._fns: SimpleNamespace | None = None
        self._built = False
        self._row_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._fp8_lut: np.ndarray | None = None
        self._last_step: StepArrays | None = None

    def resolve_residency(self, *args: Any, **kwargs: Any) -> None:
        """`ops.resolve_residency` with this backend's one-request form and kernels."""
        ops.resolve_residency(*args, one_request_path=self.one_request_path, jit=self.jit, **kwargs)

    def jit(self) -> SimpleNamespace | None:
        """The compiled kernels, or ``None`` where numba is missing or they are switched off."""
        if not self.jit_enabled:
            return None
        if not self._built:
            self._fns = build()
            self._built = True
        return self._fns

    @staticmethod
    def token_row(table: torch.Tensor, position: int, block_size: int) -> torch.Tensor:
        """The ``[1]`` int32 pool row of token ``position`` of a batch-1 step's request
        through its block-table row ``table[0]`` (``-1``: no page), from Python ints: a dozen
        tables a step, five small torch ops each otherwise."""
        page, offset = divmod(position, block_size)
        blk = int(table.numpy()[0, page])
        return torch.tensor([blk * block_size + offset if blk > 0 else -1], dtype=torch.int32)

    def resident_rows_compiled(
        self, logical_topk: torch.Tensor, req: torch.Tensor, table: torch.Tensor, block_size: int
    ) -> torch.Tensor | None:
        """`CacheHandle.resident_rows` in one compiled call (`resident_rows` kernel: a
        prefill's ``[T, top_k]`` lookup in a dozen passes of torch ops fewer); ``None``
        without numba or where an entry is not resident (the torch path then raises)."""
        fns = self.jit()
        if fns is None:
            return None
        out = torch.empty(logical_topk.shape, dtype=torch.int32)
        ok = fns.resident_rows(
            logical_topk.contiguous().numpy(), req.contiguous().numpy(),
            table.contiguous().numpy(), block_size, out.numpy(),
        )  # fmt: skip
        return out if ok else None

    @staticmethod
    def parts() -> int:
        """How many threads a compiled prefill kernel deals its tokens to (numba's parallel
        loop, set here): torch's CPU thread count. numba's OpenMP layer binds to the OpenMP
        runtime torch loaded first (its symbols come first), so the kernels and torch's ops
        take turns on one thread pool rather than two pools competing for the cores.
        Starting numba's pool (the first call) sets that runtime's count to
        ``NUMBA_NUM_THREADS`` (the cores): torch's own count (``OMP_NUM_THREADS``,
        ``torch.set_num_threads``) is put back, so ``OMP_NUM_THREADS=1`` stays one thread."""
        import numba

        threads = torch.get_num_threads()
        n = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
        numba.set_num_threads(n)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return n

    def row_buffer(self, k: int, width: int) -> torch.Tensor:
        """A ``[k, width]`` fp32 scratch buffer every layer of a step reuses (rows gathered
        for one attention call are read before the next layer gathers its own)."""
        buf = self._row_buffers.get((k, width))
        if buf is None:
            buf = self._row_buffers[(k, width)] = torch.empty(k, width)
        return buf

    def fp8_lut(self) -> np.ndarray:
        """The fp32 value of each e4m3 code (torch's conversion), as numpy."""
        if self._fp8_lut is None:
            self._fp8_lut = fp8_values().numpy()
        return self._fp8_lut

    def step_arrays(self, meta: StepMetadata) -> StepArrays:
        """numpy views of ``meta``, made once for all layers of a step (the layers of a step
        share one metadata object; the last step's views are kept)."""
        last = self._last_step
        if last is not None and last.meta is meta:
            return last
        arrays = StepArrays(meta)
        self._last_step = arrays
        return arrays
