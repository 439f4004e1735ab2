"""numba compilation of the CPU kernels (`residency_kernels`, `selection_kernels`,
`layer_kernels`).

numba is imported here only, on the first `CpuBackend.jit` call: the GPU machine has no numba,
and its absence (or ``HISPARSE_CPU_JIT=0``) makes every caller keep its numpy/torch path.
Functions compile on first use (about a second each; ``cache=True`` keeps the machine code in
``__pycache__`` when that folder is writable, and numba falls back to its per-user cache folder,
or to no cache, when it is not).
"""

from __future__ import annotations

import time
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
#: The compiled entry points (`CpuBackend.jit`'s names), each the body ``_name`` of its module.
_ENTRY_POINTS: tuple[tuple[ModuleType, tuple[str, ...]], ...] = (
    (residency_kernels, ("resolve_row", "copy_rows", "resolve_decode_row", "gather_rows",
                         "resident_rows", "finish_decode_row")),
    (selection_kernels, ("fp8_topk_row", "topk_rows", "dense_rows")),
    (layer_kernels, ("decode_pre", "attend_rows", "attend_rows_many", "write_rows_many",
                     "is_causal_prefix", "add_rms_norm")),
)  # fmt: skip
#: Entry points that deal a prefill's tokens to threads (numba's parallel loop).
_PARALLEL = ("attend_rows_many", "topk_rows")


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
    return SimpleNamespace(**{
        name: compile_(getattr(module, "_" + name), parallel=name in _PARALLEL)
        for module, names in _ENTRY_POINTS for name in names
    })  # fmt: skip


class CompileClock:
    """While entered, the spans (``time.perf_counter``) in which numba holds its compiler
    lock: compiling a kernel, or loading its machine code from the cache. numba compiles
    lazily, on a kernel's first call and in the calling thread, so these spans fall inside
    the first request's steps; a caller subtracts them to report that request's time
    without the one-time work (``hisparse generate``). ``compiled``: kernels compiled, not
    loaded from the cache. Records nothing where numba is not installed."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self.compiled = 0
        self._stack: list[tuple[str, object]] = []

    def seconds(self, start: float = float("-inf"), end: float = float("inf")) -> float:
        """Seconds of the spans inside ``[start, end]``."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.spans)

    def __enter__(self) -> CompileClock:
        try:
            from numba.core import event
        except ImportError:
            return self
        clock = self

        class _Lock(event.Listener):
            depth = 0

            def on_start(self, ev: object) -> None:
                if self.depth == 0:
                    self.t0 = time.perf_counter()
                self.depth += 1

            def on_end(self, ev: object) -> None:
                self.depth -= 1
                if self.depth == 0:
                    clock.spans.append((self.t0, time.perf_counter()))

        class _Compile(event.Listener):
            def on_start(self, ev: object) -> None:
                clock.compiled += 1

            def on_end(self, ev: object) -> None:
                pass

        for kind, listener in (("numba:compiler_lock", _Lock()), ("numba:compile", _Compile())):
            event.register(kind, listener)
            self._stack.append((kind, listener))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._stack:
            from numba.core import event

            event.unregister(*self._stack.pop())
