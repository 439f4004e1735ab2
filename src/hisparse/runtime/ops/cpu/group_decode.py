"""The CPU backend's batch-1 decode path of one index group: resolve, gathers, invalidation
and the new row's host mirror of a decode step with one query row, as compiled calls
(`CpuBackend.jit`; numpy without numba) on numpy views of the group's buffers made once per
binding. The runtime asks it first (`IndexGroupRuntime.cpu_one`) and runs its general path
where it declines; the results are the general path's bit for bit
(tests/test_cpu_decode_step.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hisparse.runtime.ops.cpu.numpy_views import np_rows

if TYPE_CHECKING:
    from hisparse.runtime.batch import GroupTables, StepMetadata

#: The arguments the compiled `finish_decode_row` takes for a layer without host rows.
_NO_PAIR = (np.zeros((1, 1, 1), np.int64), np.zeros((1, 1, 1), np.int64), 0, 0)


def _backend() -> Any:
    from hisparse.runtime.ops import cpu_backend

    return cpu_backend()


class CpuGroupDecode:
    """One index group's batch-1 CPU decode path (`IndexGroupRuntime.cpu_one`)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        #: numpy views of the state and output buffers (`arrays`)
        self._np: dict[str, np.ndarray] | None = None
        #: ``(slot, q)`` -> the state and output rows `decode_one` passes (`_rows`)
        self._row_args: dict[tuple[int, int], tuple] = {}
        #: each layer's (host rows, device rows, host rows count, device rows count) as numpy
        #: (``None``: a view not bound); made with `_np`
        self._pairs: list[tuple[np.ndarray, np.ndarray, int, int] | None] = []

    def forget(self) -> None:
        """The group (re)bound a buffer or view: the numpy views are made again."""
        self._np = None
        self._row_args = {}

    def invalidate_one(self, meta: StepMetadata) -> bool:
        """`IndexGroupRuntime.invalidate_written` of a batch-1 decode step: the written host
        row out of the slot's held set, in numpy. ``False``: not such a step."""
        if not meta.is_decode:
            return False
        step = _backend().step_arrays(meta)
        q, row = step.q, step.host_row
        if row >= 0 and 0 <= q < step.state.shape[0]:
            s = int(step.state[q])
            if 0 <= s < self.group.hot_index.shape[0]:
                held = self.arrays()["hot_index"][s]
                held[held == row] = -1
                return True
        return False

    def arrays(self) -> dict[str, np.ndarray]:
        """numpy views (shared memory) of the buffers the compiled decode path reads and
        writes, and of each layer's host and device rows; made once per binding."""
        g = self.group
        if self._np is None:
            arrays = {
                name: getattr(g, name).numpy()
                for name in ("hot_index", "lru", "hot_block_table", "physical",
                             "valid_counts", "swap_src", "swap_dst", "swap_count",
                             "hit_miss", "totals")
            }  # fmt: skip
            pairs: list[tuple[np.ndarray, np.ndarray, int, int] | None] = []
            for i, ly in enumerate(g.layers):
                pair = None
                if ly.host_view is not None and ly.device_view is not None:
                    host = arrays[f"host{i}"] = np_rows(ly.host_view)
                    dev = arrays[f"dev{i}"] = np_rows(ly.device_view)
                    pair = (host, dev, host.shape[0] * host.shape[1], dev.shape[0] * dev.shape[1])
                pairs.append(pair)
            self._pairs = pairs
            self._np = arrays
        return self._np

    def _rows(self, s: int, q: int) -> tuple:
        """What `decode_one` passes for state slot ``s`` and query row ``q``, made once
        per binding: (slot ``s``'s hot block table, held rows and LRU order, block size),
        the output row, (swap lists, counters, layers), each layer's (name, has host rows,
        host rows, device rows) (``None``: not bound) and query ``q``'s swap lists."""
        g, a = self.group, self.arrays()
        state = (a["hot_block_table"][s], a["hot_index"][s], a["lru"][s], g.config.block_size)
        tail = (a["swap_src"], a["swap_dst"], q, a["valid_counts"], a["swap_count"],
                a["hit_miss"], a["totals"], len(g.layers))  # fmt: skip
        copies = [
            (ly.name, ly.host_view is not None, a.get(f"host{i}"), a.get(f"dev{i}"))
            for i, ly in enumerate(g.layers)
        ]
        args = (state, a["physical"][0], tail, copies, a["swap_src"][q], a["swap_dst"][q])
        self._row_args[(s, q)] = args
        return args

    def decode_one(self, meta: StepMetadata, tables: GroupTables, topk: torch.Tensor) -> bool:
        """A decode step with one query row: resolve, count and gather every layer of the
        group in compiled calls (`CpuBackend.jit`), with the results of the group's
        `_resolve`, `_count_step` and the layers' `gather_swapped_rows` bit for bit.
        ``False``: not such a step, or an input the general path must handle (it then runs
        from the same state)."""
        fns = _backend().jit()
        if fns is None or not meta.is_decode or topk.shape[0] != 1 or not topk.is_cpu:
            return False
        g = self.group
        if g.config.max_query_len < 1 or not g.totals.is_cpu:
            return False
        g.check_rows(topk)
        step = _backend().step_arrays(meta)
        q, s, S = step.q, step.slot, g.max_num_reqs
        if s < 0:
            return False  # padding (the general path only clears the outputs)
        if s >= S or q >= S or q >= step.source.shape[0]:
            return False
        res = step.resident_of(tables)
        if res is not None and q >= res.shape[0]:
            return False
        rows = self._row_args.get((s, q))
        if rows is None:
            rows = self._rows(s, q)
        state, out, tail, copies, src, dst = rows
        source = step.source[q]
        n_miss = fns.resolve_decode_row(
            topk.numpy()[0], source, source if res is None else res[q], res is not None,
            *state, out[: topk.shape[1]], *tail,
        )  # fmt: skip
        if n_miss < 0:
            return False  # nothing was written: the general path starts from the same state
        if n_miss:
            for name, has_host, host, dev in copies:
                if has_host:
                    assert dev is not None, f"{name}: device view not bound"
                    fns.copy_rows(host, dev, src, dst, n_miss)
        for layer in g.layers:
            layer.mark_ready()
        return True

    def finish_one(self, layer: Any, meta: StepMetadata, tables: GroupTables) -> bool:
        """`CacheHandle.finish_kv_update` of a batch-1 decode step in one compiled call (numpy
        without numba) on views made once per step and binding: the leader's
        `invalidate_written` of the step's host row and the layer's mirror of its new row
        (`gather_plan`), the same bytes and hot state. ``False``: not such a step, or an input
        the general path handles (nothing was done)."""
        if meta.num_tokens != 1 or not meta.is_decode:
            return False
        g = self.group
        if meta.host_slot_mapping is None:
            return True  # nothing written to the host: no invalidation, no mirror
        step = _backend().step_arrays(meta)
        row, q, s = step.host_row, step.q, step.slot
        H = g.hot_index.shape[0]
        leader = layer is g.layers[0]
        drop = leader and row >= 0 and 0 <= s < H
        if leader and row >= 0 and q >= 0 and (q >= step.state.shape[0] or s >= H):
            return False  # the general path raises the IndexError
        mirror = (
            layer.host_view is not None and layer.config.eager_host_mirror and layer.writes_host
        )
        copy = False
        a = self.arrays()
        pair = self._pairs[g.layers.index(layer)] if mirror else None
        dev_row = -1
        if mirror:
            if pair is None:
                return False  # a view is not bound: the general path fails as before
            dev_row = step.dev_row_of(tables)
            copy = row >= 0 and dev_row >= 0
            if copy and (row >= pair[2] or dev_row >= pair[3]):
                return False  # out of range: the general path raises
        else:
            pair = _NO_PAIR
        fns = _backend().jit()
        if fns is not None:
            fns.finish_decode_row(a["hot_index"], drop, s, row, pair[1], pair[0], dev_row,
                                  row, copy)  # fmt: skip
            return True
        if drop:
            held = a["hot_index"][s]
            held[held == row] = -1
        if copy:
            host, dev = pair[0], pair[1]
            hb, db = host.shape[1], dev.shape[1]
            host[row // hb, row % hb] = dev[dev_row // db, dev_row % db]
        return True
