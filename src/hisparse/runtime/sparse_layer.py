"""One sparse layer's HiSparse data plane (`SparseLayerRuntime`): its host rows, its GPU
rows (resident and hot) and the event its attention waits on. The state its index group shares
is `hisparse.runtime.index_group.IndexGroupRuntime`.
"""

from __future__ import annotations

import torch

from hisparse.config import ResolvedHiSparseConfig
from hisparse.kv.host_pool import is_host_pool_memory
from hisparse.runtime.index_group import IndexGroupRuntime
from hisparse.runtime.streams import CopyStream, LayerEvent


class SparseLayerRuntime:
    """One sparse layer's host rows, GPU rows (resident + hot) and its ready event."""

    def __init__(
        self,
        name: str,
        config: ResolvedHiSparseConfig,
        *,
        row_bytes: int,
        max_num_reqs: int,
        device: torch.device | str,
        index_group: IndexGroupRuntime | None = None,
        copy_stream: CopyStream | None = None,
        hisparse: bool = True,
    ) -> None:
        config.check_row_bytes(row_bytes, what=f"{name} KV row")
        self.name = name
        self.config = config
        self.row_bytes = row_bytes
        self.device = torch.device(device)
        #: the HiSparse placement (False: all-GPU, every row resident)
        self.hisparse = hisparse
        if index_group is None:
            index_group = IndexGroupRuntime(
                config,
                max_num_reqs=max_num_reqs,
                device=self.device,
                copy_stream=copy_stream,
                hot_slots=None if hisparse else 1,
            )
        elif index_group.max_num_reqs != max_num_reqs:
            raise ValueError("followers must share their leader's max_num_reqs")
        index_group.layers.append(self)
        self.group = index_group
        self.event: LayerEvent = index_group.copy.new_event()
        self.staged = False
        self._await_copy = False  # whether wait_ready waits for the copy stream
        self.device_view: torch.Tensor | None = None
        self.host_view: torch.Tensor | None = None
        #: Does this process write the layer's host mirror? Tensor parallelism with rows that
        #: are the same on every rank (MLA) leaves it to one rank per node (docs/design.md
        #: §18); the others read rows that rank wrote.
        self.writes_host = True

    @property
    def is_leader(self) -> bool:
        return self.group.leader is self

    def _check_view(self, view: torch.Tensor, where: str) -> None:
        if view.dim() != 3 or view.dtype != torch.uint8 or view.shape[2] != self.row_bytes:
            raise ValueError(
                f"{self.name}: {where} view must be uint8 [blocks, block_size, {self.row_bytes}],"
                f" got {view.dtype} {tuple(view.shape)}"
            )
        if view.shape[1] != self.config.block_size:
            raise ValueError(
                f"{self.name}: {where} block size {view.shape[1]} != configured "
                f"{self.config.block_size}"
            )

    def bind_device(self, view: torch.Tensor) -> None:
        """This layer's rows in the shared GPU pool: resident pages and hot regions alike."""
        self._check_view(view, "device")
        self.device_view = view
        self.group.views_changed()

    def bind_host(self, view: torch.Tensor) -> None:
        """This layer's rows in the host pool (pinned on CUDA: read by the GPU directly)."""
        if not self.hisparse:
            raise ValueError(f"{self.name}: all-GPU placement has no host rows")
        self._check_view(view, "host")
        if view.device.type != "cpu":
            raise ValueError(f"{self.name}: the host pool must be host memory, got {view.device}")
        if self.device.type == "cuda" and not is_host_pool_memory(view):
            raise ValueError(f"{self.name}: the host pool must be pinned (cudaHostRegister)")
        self.host_view = view
        self.group.views_changed()

    def gather_swapped_rows(self) -> None:
        """Copy this layer's misses of the last resolve into its hot rows; mark it ready."""
        g = self.group
        if self.host_view is not None:
            assert self.device_view is not None, f"{self.name}: device view not bound"
            g.ops.gather_compact(
                self.host_view, self.device_view, g.swap_src, g.swap_dst, g.swap_count
            )
        self.mark_ready()

    def mark_ready(self, on_compute: bool = False) -> None:
        """Mark this layer's rows enqueued: its ready event on the copy stream (none when the
        group swaps in on the compute stream, or ``on_compute`` says this step's rows came
        from there: program order already waits)."""
        self._await_copy = not (on_compute or self.group.inline_swap_in)
        if self._await_copy:
            self.event.record()
        self.staged = True

    def stage_own_rows(self) -> None:
        """A follower outside decode gathers its own rows after its KV write."""
        g = self.group
        g.copy.wait_for_compute()
        with g.copy.active():
            self.gather_swapped_rows()

    def wait_ready(self) -> None:
        if not self.staged:
            raise RuntimeError(
                f"{self.name}: swap-in was not staged; the index-group leader "
                f"({self.group.leader.name}) must call swap_in first in each step."
            )
        if self._await_copy:
            self.event.wait()
        self.staged = False
