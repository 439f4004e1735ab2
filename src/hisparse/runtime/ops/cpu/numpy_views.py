"""numpy views of torch tensors for the compiled CPU kernels (shared memory, no copies)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

U8 = np.dtype(np.uint8)
F32 = np.dtype(np.float32)

#: How many storages and views a `NumpyViews` remembers.
_REMEMBER_MAX = 256


def np_rows(view: torch.Tensor) -> np.ndarray:
    """A paged ``[blocks, block_size, W]`` uint8 view as numpy, in 8-byte words where the
    strides allow (a compiled row copy then moves W / 8 words instead of W bytes)."""
    for dtype in (torch.int64, torch.int32):
        size = dtype.itemsize
        if (
            view.stride(-1) == 1
            and view.shape[-1] % size == 0
            and all(st % size == 0 for st in view.stride()[:-1])
            and view.storage_offset() % size == 0
        ):
            return view.view(dtype).numpy()
    return view.numpy()


class NumpyViews:
    """Paged rows and index pages as ``(flat, layout)`` numpy pairs, remembered.

    Storages are remembered by (address, bytes, item type) and views by identity, both bounded;
    an entry keeps its storage or tensor alive, so no other one can take its address or id
    while it is remembered.
    """

    def __init__(self) -> None:
        self._flat: dict[tuple[int, int, str], np.ndarray] = {}
        self._paged: dict[tuple[int, str, int], tuple[torch.Tensor, object]] = {}

    def paged_rows(
        self, view: torch.Tensor, dtype: np.dtype
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """`_paged_rows`, remembered per view (tensors whose shape, strides and storage never
        change after creation, as the caches' views)."""
        return self._remembered((id(view), dtype.str, 0), view,
                                lambda: self._paged_rows(view, dtype))  # fmt: skip

    def paged_pages(
        self, pages: torch.Tensor, row_bytes: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """`_paged_pages`, remembered per pages tensor."""
        return self._remembered((id(pages), "pages", row_bytes), pages,
                                lambda: self._paged_pages(pages, row_bytes))  # fmt: skip

    def _remembered(self, key: tuple[int, str, int], t: torch.Tensor, make: Callable[[], object]):
        hit = self._paged.get(key)
        if hit is not None and hit[0] is t:
            return hit[1]
        value = make()
        if len(self._paged) >= _REMEMBER_MAX:
            self._paged.pop(next(iter(self._paged)))
        self._paged[key] = (t, value)
        return value

    def _flat_storage(self, t: torch.Tensor, dtype: np.dtype) -> np.ndarray:
        """The whole storage of ``t`` as a flat ``dtype`` numpy array."""
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes(), dtype.str)
        arr = self._flat.get(key)
        if arr is None:
            whole = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
            arr = whole[: st.nbytes() - st.nbytes() % dtype.itemsize].numpy().view(dtype)
            if len(self._flat) >= _REMEMBER_MAX:
                self._flat.pop(next(iter(self._flat)))
            self._flat[key] = arr
        return arr

    def _paged_rows(
        self, view: torch.Tensor, dtype: np.dtype
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """``(flat, layout)`` of paged rows ``view [blocks, bs, row bytes]`` (uint8) for the
        compiled functions: ``flat`` the whole storage as a 1-D ``dtype`` numpy array (shared
        memory; contiguous, so loops over a row vectorise whatever the pool's strides),
        ``layout`` int64 ``[offset, block stride, row stride, block size, row width]`` in items.
        ``None`` where the strides are not whole items."""
        size = dtype.itemsize
        if view.dim() != 3 or view.dtype != torch.uint8 or view.stride(2) != 1:
            return None
        if view.storage_offset() % size or any(st % size for st in view.stride()[:2]):
            return None
        if view.shape[2] % size:
            return None
        _, bs, width = view.shape
        layout = np.array(
            [view.storage_offset() // size, view.stride(0) // size, view.stride(1) // size, bs,
             width // size], dtype=np.int64,
        )  # fmt: skip
        return self._flat_storage(view, dtype), layout

    def _paged_pages(
        self, pages: torch.Tensor, row_bytes: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """`_paged_rows` of index pages ``[blocks, bs · row_bytes]`` (uint8 items)."""
        if pages.dim() != 2 or pages.dtype != torch.uint8 or pages.stride(1) != 1:
            return None
        if pages.shape[1] % row_bytes:
            return None
        return self._paged_rows(pages.unflatten(1, (pages.shape[1] // row_bytes, row_bytes)), U8)
