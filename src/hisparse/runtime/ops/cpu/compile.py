"""numba compilation of the CPU kernels (`residency_kernels`, `selection_kernels`,
`layer_kernels`).

numba is imported here only, on the first `CpuBackend.jit` call: the GPU machine has no numba,
and its absence (or ``HISPARSE_CPU_JIT=0``) makes every caller keep its numpy/torch path.
Functions compile on first use (about a second each; ``cache=True`` keeps the machine code in
``__pycache__`` when that folder is writable, and numba falls back to its per-user cache folder,
or to no cache, when it is not).
"""

from __future__ import annotations

import warnings
from types import ModuleType, SimpleNamespace

from hisparse.runtime.ops.cpu import layer_kernels, residency_kernels, selection_kernels

#: The modules whose plain-Python bodies are compiled.
KERNEL_MODULES: tuple[ModuleType, ...] = (residency_kernels, selection_kernels, layer_kernels)

#: Helpers called from compiled functions, callees first; those in `_REASSOCIATE` may sum in
#: any order.
_HELPERS = (
    "_argsort_stable",
    "_search",
    "_fp8_encode",
    "_dots",
    "_sum_squares",
    "_exp_shifted",
    "_mark_best",
    "_row_max",
    "_row_sum",
    "_select_row",
    "_fp8_topk_row",
    "_attend_rows",
    "_resolve_row",
)
_REASSOCIATE = ("_dots", "_sum_squares", "_row_sum")


def _owner(name: str) -> ModuleType:
    """The kernel module that defines ``name`` (not one that imports it)."""
    return next(m for m in KERNEL_MODULES if name in vars(m) and _defined_in(vars(m)[name], m))


def _defined_in(fn: object, module: ModuleType) -> bool:
    return getattr(getattr(fn, "py_func", fn), "__module__", None) == module.__name__


def build() -> SimpleNamespace | None:
    """The compiled entry points, or ``None`` where numba is missing.

    numba resolves a callee from its caller's module globals at compile time, so each helper
    is compiled once and put in place of the Python function in every kernel module that names
    it (its own and those importing it), and ``prange`` becomes numba's parallel range. That
    rebinding is the same function, compiled, and happens once per process.
    """
    try:
        import numba
    except ImportError:
        return None

    def compile_(fn, fastmath: set[str] | bool = False, parallel: bool = False):
        if isinstance(fn, numba.core.dispatcher.Dispatcher):  # a helper, compiled above
            return fn
        opts = {"nogil": True, "fastmath": fastmath, "parallel": parallel}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NumbaWarning when no cache folder is writable
            try:
                return numba.njit(cache=True, **opts)(fn)
            except Exception:  # pragma: no cover - no cache locator at all
                return numba.njit(**opts)(fn)

    for module in KERNEL_MODULES:
        if "prange" in vars(module):
            module.prange = numba.prange
    for name in _HELPERS:
        reassociate = {"reassoc", "contract"} if name in _REASSOCIATE else False
        compiled = compile_(getattr(_owner(name), name), reassociate)
        for module in KERNEL_MODULES:
            if name in vars(module):
                setattr(module, name, compiled)
    res, sel, lay = residency_kernels, selection_kernels, layer_kernels
    return SimpleNamespace(
        resolve_row=compile_(res._resolve_row),
        copy_rows=compile_(res._copy_rows),
        resolve_decode_row=compile_(res._resolve_decode_row),
        fp8_topk_row=compile_(sel._fp8_topk_row),
        gather_rows=compile_(res._gather_rows),
        decode_pre=compile_(lay._decode_pre),
        attend_rows=compile_(lay._attend_rows),
        attend_rows_many=compile_(lay._attend_rows_many, parallel=True),
        topk_rows=compile_(sel._topk_rows, parallel=True),
        resident_rows=compile_(res._resident_rows),
        write_rows_many=compile_(lay._write_rows_many),
        dense_rows=compile_(sel._dense_rows),
        is_causal_prefix=compile_(lay._is_causal_prefix),
        add_rms_norm=compile_(lay._add_rms_norm),
        fp8_encode=compile_(lay._fp8_encode),
        finish_decode_row=compile_(res._finish_decode_row),
    )
